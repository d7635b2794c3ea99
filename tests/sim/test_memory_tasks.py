"""Memory tasks: experts succeed, the cue never leaks past its phase, the counting rule, chance levels, cue draws."""

import importlib.util
from dataclasses import replace

import numpy as np
import pytest

from vla_runtime.sim import MEMORY_TASKS, MetaWorldConfig, MetaWorldEnv
from vla_runtime.sim.memory import CountingTask, OrderTask, Outcome, ReferenceTask, TallyTask, memory_task
from vla_runtime.sim.memory.counting import PressStage
from vla_runtime.sim.memory.reach import DELAY_MAX, DELAY_MIN, SUCCESS_RADIUS, with_delay
from vla_runtime.sim.memory.reference import GOAL_HIGH, GOAL_LOW

# find_spec, not importorskip: importing mujoco here would fix its GL backend before the env picks it
needs_metaworld = pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed")
TASKS = list(MEMORY_TASKS)


@pytest.fixture(scope="module")
def blind_env():
    """State-only env: the experts and the judges do not need images."""
    with MetaWorldEnv(MetaWorldConfig(cameras=())) as env:
        yield env


def run_expert(env: MetaWorldEnv):
    """Step the current episode with the expert to its end -> (success, info)."""
    done = success = False
    while not done:
        _, done, success, info = env.step(env.expert_action())
    return success, info


@needs_metaworld
@pytest.mark.sim
@pytest.mark.parametrize("task", TASKS)
def test_expert_succeeds_on_fixed_seeds(blind_env, task):
    for seed in (0, 1, 2, 3):
        obs = blind_env.reset(task, seed)
        assert obs.instruction == blind_env.instruction(task, seed)
        success, info = run_expert(blind_env)
        assert success and not info.truncated, (task, seed, blind_env._episode)
        assert info.step < MEMORY_TASKS[task].max_steps and info.extra["success"] == 1.0
        # the steps whose frames show the cue (counting: where each press was counted) reach the episode's result
        # (retention pictures mark them)
        if task == "memory-counting":
            assert len(info.extra["cue_steps"]) == info.extra["presses"] == blind_env._episode.presses
        else:
            shown = [t for t in range(20) if blind_env._episode.cue_markers(t)]
            assert info.extra["cue_steps"] == shown and shown


def frames_and_states(env: MetaWorldEnv, episode, steps: int):
    """Observations 0..steps of ``episode`` under its expert: (images [steps+1, H, W, 3], states [steps+1, 4])."""
    obs = env.reset_memory(episode)
    images, states = [obs.images["corner"]], [obs.state]
    for _ in range(steps):
        obs, _, _, _ = env.step(env.expert_action())
        images.append(obs.images["corner"])
        states.append(obs.state)
    return np.stack(images), np.stack(states)


@needs_metaworld
@pytest.mark.sim
@pytest.mark.parametrize(
    "first, second",
    [
        (ReferenceTask(delay=22, goal=(-0.2, 0.5)), ReferenceTask(delay=22, goal=(0.1, 0.7))),
        (OrderTask(delay=21, row=(-0.06, 0.6), first=0, second=2), OrderTask(delay=21, row=(-0.06, 0.6), first=2, second=0)),
        (TallyTask(delay=21, row=(-0.06, 0.6), lit=(0, 2, 4)), TallyTask(delay=21, row=(-0.06, 0.6), lit=(1,))),
    ],
    ids=["reference", "order", "tally"],
)
def test_no_leak_after_the_cue_phase(first, second):
    """Episodes with different cues render the same frames and robot state from the end of the cue to the go
    step: during the delay the answer is only in the past. The cue itself is visible, and the answers differ."""
    go = first.go_step
    with MetaWorldEnv(MetaWorldConfig(cameras=("corner",), resolution=(84, 84))) as env:
        images_a, states_a = frames_and_states(env, first, go + 12)
        images_b, states_b = frames_and_states(env, second, go + 12)
    shown = [t for t in range(first.cue_steps) if first.cue_markers(t)]  # the order task has a gap between its lights
    after_cue = slice(first.cue_steps, go + 1)  # observation `go` is the first with the green lamp; nothing moved yet
    assert len(shown) >= 6 and all(not np.array_equal(images_a[t], images_b[t]) for t in shown)  # the cue shows...
    np.testing.assert_array_equal(images_a[after_cue], images_b[after_cue])  # ...and then leaves no trace
    np.testing.assert_array_equal(states_a[: go + 1], states_b[: go + 1])  # the arm was held in both
    assert not np.array_equal(images_a[go - 1], images_a[go])  # the lamp changed colour at go
    assert np.abs(states_a[-1, :3] - states_b[-1, :3]).max() > 0.02  # then each expert heads for its own answer


@needs_metaworld
@pytest.mark.sim
def test_counting_leaves_no_trace_in_the_scene(blind_env):
    """After each press the button springs back to where it started: the count is only in the robot's past."""
    from vla_runtime.sim.memory.counting import BUTTON_JOINT

    episode = replace(CountingTask.sample(5), presses=3)
    blind_env.reset_memory(episode)
    mw = blind_env._sim.env.unwrapped
    rest = float(mw.data.joint(BUTTON_JOINT).qpos[0])
    seen, released, pressed_at = [], [], []
    done = False
    while not done:
        _, done, success, info = blind_env.step(blind_env.expert_action())
        count = int(info.extra["presses"])
        if count > len(seen):
            seen.append(count)
            pressed_at.append(info.step)
        if len(released) < len(seen) and abs(float(mw.data.joint(BUTTON_JOINT).qpos[0]) - rest) < 1e-3:
            released.append(info.step)
    assert success and seen == [1, 2, 3] and len(released) == 3
    assert info.extra["cue_steps"] == pressed_at  # the observations each press was counted at: what to remember


@needs_metaworld
@pytest.mark.sim
@pytest.mark.parametrize("made, outcome", [(1, Outcome.FAILURE), (2, Outcome.SUCCESS), (3, Outcome.FAILURE)], ids=["N-1", "N", "N+1"])
def test_counting_rule_exactly_n_presses(blind_env, made, outcome):
    """Asked for N = 2: an expert pressing twice succeeds; once fails when it backs off; a third press fails at once."""
    episode = replace(CountingTask.sample(7), presses=2)
    blind_env.reset_memory(episode, belief=replace(episode, presses=made))
    success, info = run_expert(blind_env)
    assert episode.outcome is outcome and success == (outcome is Outcome.SUCCESS) and not info.truncated
    assert info.extra["presses"] == made
    if made > episode.presses:  # judged at the extra press itself, while the hand still pushes
        assert blind_env._expert.stage is PressStage.PRESS


def test_chance_levels_match_the_cue_distributions():
    """The stated chance level is the best cue-blind answer's rate under each task's own cue draws."""
    seeds = range(3000)
    goals = np.array([ReferenceTask.sample(s).goal for s in seeds])
    centre = (np.array(GOAL_LOW) + np.array(GOAL_HIGH)) / 2
    hit_centre = np.mean(np.linalg.norm(goals - centre, axis=1) < SUCCESS_RADIUS)
    assert ReferenceTask.chance_level() == pytest.approx(np.pi * 0.06**2 / (0.4 * 0.3))
    assert hit_centre == pytest.approx(ReferenceTask.chance_level(), abs=0.015)
    firsts = np.bincount([OrderTask.sample(s).first for s in seeds], minlength=3) / len(seeds)
    assert OrderTask.chance_level() == pytest.approx(1 / 3) and firsts.max() == pytest.approx(1 / 3, abs=0.03)
    counts = np.bincount([CountingTask.sample(s).presses for s in seeds], minlength=5)[1:] / len(seeds)
    assert CountingTask.chance_level() == 0.25 and counts.max() == pytest.approx(0.25, abs=0.03)
    tallies = [TallyTask.sample(s) for s in seeds]
    flashes = np.bincount([t.count for t in tallies], minlength=4)[1:] / len(seeds)
    assert TallyTask.chance_level() == pytest.approx(1 / 3) and flashes.max() == pytest.approx(1 / 3, abs=0.03)


def test_tally_frames_after_the_cue_and_the_go_step_say_nothing_about_the_count():
    """The cue phase has one length for every count, and every slot is lit about as often whatever the count:
    neither when the lamp turns green nor when a flash came tells how many there were."""
    tallies = [TallyTask.sample(s) for s in range(3000)]
    assert {t.cue_steps for t in tallies} == {20} and {t.go_step - t.delay for t in tallies} == {20}
    for count in (1, 2, 3):
        lit = np.zeros(5)
        group = [t for t in tallies if t.count == count]
        for t in group:
            lit[list(t.lit)] += 1
        np.testing.assert_allclose(lit / len(group), count / 5, atol=0.05)  # a flash at any slot, whatever the count
        delays = [t.delay for t in group]
        assert min(delays) == DELAY_MIN and max(delays) == DELAY_MAX
    shown = TallyTask(delay=30, row=(0.0, 0.6), lit=(1, 3)).cue_shown()
    assert shown == [4, 5, 12, 13]  # two flashes of two frames, dark between


@pytest.mark.parametrize("task", TASKS)
def test_cues_vary_by_seed_beyond_fifty_variations(task):
    cls = memory_task(task)
    episodes = [cls.sample(s) for s in range(400)]
    assert cls.sample(123) == cls.sample(123)  # a seed is one episode
    assert len({repr(e) for e in episodes}) == 400  # continuous draws: no two seeds alike (MT1 repeats every 50)
    delays = [e.delay for e in episodes if hasattr(e, "delay")]
    if delays:
        assert min(delays) == DELAY_MIN and max(delays) == DELAY_MAX
    texts = {e.instruction() for e in episodes}
    assert all("0." not in t and "(" not in t for t in texts)  # never a position


def test_bad_episode_parameters_and_names_are_clear_errors():
    with pytest.raises(KeyError, match="unknown memory task 'memory-x'; known: memory-reference, memory-counting, memory-order, memory-tally"):
        memory_task("memory-x")
    with pytest.raises(ValueError, match=r"`presses` must be one of \(1, 2, 3, 4\), got 5"):
        CountingTask(presses=5, box=(0.0, 0.8))
    with pytest.raises(ValueError, match=r"`delay` must be >= 1 step, got 0"):
        ReferenceTask(delay=0, goal=(0.0, 0.6))
    with pytest.raises(ValueError, match="two different pads"):
        OrderTask(delay=30, row=(0.0, 0.6), first=1, second=1)
    with pytest.raises(ValueError, match=r"`lit` must be 1..3 increasing slots in 0..4, got \(2, 2\)"):
        TallyTask(delay=30, row=(0.0, 0.6), lit=(2, 2))
    with pytest.raises(ValueError, match=r"`lit` must be .*, got \(\)"):
        TallyTask(delay=30, row=(0.0, 0.6), lit=())
    with pytest.raises(ValueError, match="seed must be >= 0"):
        ReferenceTask.sample(-1)


def test_other_delays_keep_each_seeds_cue_and_layout():
    for seed in range(50):
        order, longer = OrderTask.sample(seed), with_delay(OrderTask.sample(seed), seed, (70, 110))
        assert 70 <= longer.delay <= 110 and longer == replace(order, delay=longer.delay)  # only the delay moves
        assert longer == with_delay(OrderTask.sample(seed), seed, (70, 110))  # a seed is one episode
        assert longer.step_limit() == OrderTask.max_steps + longer.delay - DELAY_MAX  # time to answer kept
    assert {with_delay(ReferenceTask.sample(s), s, (5, 9)).delay for s in range(200)} == set(range(5, 10))
    counting = CountingTask.sample(3)
    assert with_delay(counting, 3, (70, 110)) is counting  # no delay to draw
    with pytest.raises(ValueError, match="memory delays must be 1 <= low <= high steps, got 9:5"):
        with_delay(OrderTask.sample(0), 0, (9, 5))
    with pytest.raises(ValueError, match="`memory_delays` must be"):
        MetaWorldConfig(memory_delays=(0, 5))


@needs_metaworld
@pytest.mark.sim
def test_a_longer_delay_holds_the_arm_longer_and_the_expert_still_answers():
    with MetaWorldEnv(MetaWorldConfig(cameras=(), memory_delays=(100, 100))) as env:
        env.reset("memory-order", 5)
        episode = env._episode
        assert episode.delay == 100 and episode.go_step == episode.cue_steps + 100
        assert [episode.frozen(t) for t in (episode.go_step - 1, episode.go_step)] == [True, False]
        success, info = run_expert(env)
        assert success and not info.truncated and info.step > 100


@needs_metaworld
@pytest.mark.sim
@pytest.mark.parametrize("task", TASKS)
def test_answers_tell_the_cue_followed_from_the_one_believed(blind_env, task):
    """The last step's info records the answer; ``answers`` counts a right one and one given for another cue
    (the expert acting on a wrong belief) apart: the lure pad, a far miss, a wrong number of presses."""
    cls = MEMORY_TASKS[task]
    episode = cls.sample(11)
    if task == "memory-order":
        wrong = replace(episode, first=episode.second, second=episode.first)
    elif task == "memory-reference":  # the corner of the goal area farthest from the spot
        corners = [(x, y) for x in (GOAL_LOW[0], GOAL_HIGH[0]) for y in (GOAL_LOW[1], GOAL_HIGH[1])]
        wrong = replace(episode, goal=max(corners, key=lambda c: np.hypot(c[0] - episode.goal[0], c[1] - episode.goal[1])))
    elif task == "memory-tally":  # one flash missed, or one too many when there was a single flash
        wrong = replace(episode, lit=episode.lit[1:] if episode.count > 1 else (0, 1))
    else:
        wrong = replace(episode, presses=episode.presses + 1 if episode.presses < 4 else 1)
    infos = []
    for belief in (episode, wrong):
        blind_env.reset_memory(replace(episode), belief=belief)
        success, info = run_expert(blind_env)
        assert success == (belief is episode)
        infos.append(info.extra)
    counted = cls.answers(infos)
    if task == "memory-order":
        assert counted == {"first": 1, "second": 1, "other": 0, "no answer": 0}
        assert cls.answers([{}])["no answer"] == 1  # an episode cut by the step limit committed nothing
    elif task == "memory-reference":
        assert infos[0]["miss_m"] < SUCCESS_RADIUS and infos[1]["miss_m"] >= 3 * SUCCESS_RADIUS
        assert counted == {"< 6 cm": 1, "6-12 cm": 0, "12-18 cm": 0, ">= 18 cm": 1, "no answer": 0}
        assert cls.answers([{}])["no answer"] == 1
    elif task == "memory-tally":
        n, m = episode.count, wrong.count
        assert counted == dict(sorted({f"N={n} answered {n}": 1, f"N={n} answered {m}": 1}.items()))
        assert cls.answers([{"count": 2.0}]) == {"no answer": 1}
    else:
        n, m = episode.presses, wrong.presses
        assert counted == dict(sorted({f"N={n} made {n}": 1, f"N={n} made {m}": 1}.items()))
