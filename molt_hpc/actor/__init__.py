"""The actor pool: the FSDP2 trainer of the policy (with its frozen reference and optional critic).

Every torchrun rank runs `molt_hpc.actor.trainer.main(cfg, run_dir)` (the stages:
`molt_hpc.actor.supervised.main`); rank 0 also claims groups from
the replay buffer, sends refits to the engines and coordinates checkpoints. Modules:
`world` (process group, device, meshes), `packing` (micro-batches, samples packed into rows),
`build` (models, optimizers, LR schedule; `molt_hpc.parallel.parallelize` lays each model out over the
ranks), `moe_router` (MoE routers: replay, aux losses, routing metrics), `weights` (full weights gathered
bucket by bucket), `state` (checkpoint save and restore), `feed` (groups from the buffer to every rank),
`step` (one training step), `sync` (refits), `control` (signals and control files), `trainer` (the one
loop, fed by a task: `task` the contract, `rl` RL's, `supervised` the SFT (`sft`) and reward-model (`rm`)
stages'),
`vision` (a vision-language policy's pixel values and multimodal positions per micro-batch),
`batch` (one step's experience cut into this rank's micro-batches, and the model forwards over them),
`head` (the last hidden states and the LM head weight of a forward, so the log-probs never see full logits),
`clip` (global gradient-norm clipping over FSDP2's sharded gradients, on the local shards), `memory` (peak
memory of each training step, for `metrics.jsonl`), `offload` (AdamW's state in pinned host memory between
steps), `save_behind` (checkpoints written behind the training: a step pays for the host copies only),
`lora` (LoRA policies: peft's low-rank adapters over a frozen base) and `lora_merge` (`molt-hpc model merge`:
a LoRA checkpoint's adapters merged into their base, written as a plain HF model).
"""
