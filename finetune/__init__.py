"""Fine-tuning of the KV-Efficient gating modules (peft LoRA on the policy), imported as ``vla_finetune``.

    python -m vla_finetune.train --checkpoint CKPT --dataset LEROBOT_DIR --out RUN     (or ``vla-runtime finetune``)
    load_policy(CKPT, adapter=RUN)

Modules, in data-flow order: ``config`` (``FinetuneConfig``), ``args`` (flags <-> config), ``frames``
(decode a LeRobot dataset once, memory-mapped), ``statistics`` (``dataset_statistics.json``), ``layout``
(windows laid out as the runtime streams them), ``data`` (windows, buckets, micro-batches), ``lora``
(``apply_lora``), ``model`` (the training forward and loss), ``trainer`` (setup, DDP, loop, resume),
``outputs`` (files a run writes), ``merge`` (LoRA merged into the checkpoint), ``train`` (entry point).
"""
