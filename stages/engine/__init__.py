"""The training engine: what train_dpo, train_rm and ref_logps run. Read it in this order:

    loop.py      train(): build the run, probe at step 0, the steps, probe at the end, export, records
    steps.py     one optimizer step, eager or as CUDA graphs, behind one interface (capture and replay too)
    optim.py     AdamW, MasterWeightAdamW (fp32 masters for bf16 weights), the learning-rate schedule
    data.py      packed batches (prefetched off the critical path) and the no-grad inference pass
    dist.py      process group, devices, precision contexts, DDP / FSDP2 wrapping
    export.py    the Hugging Face directory others load
    settings.py  params.yaml's `train` section (the schema is its only definition)
    cli.py       what the engine's stage CLIs share

What a step computes per objective is stages/engine/objectives.py (the interface), dpo_objective.py (its losses:
the registry dpo_losses.py) and reward_objective.py; the plan's checks before a run guards.py; packing and the
planned batches stages/engine/packing.py; the model adapters and fused kernels stages/engine/modeling.py and
kernels.py; checkpoints stages/engine/checkpoint.py.
"""
