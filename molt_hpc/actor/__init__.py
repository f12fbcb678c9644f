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
`vision` (a vision-language policy's pixel values and multimodal positions per micro-batch).
"""
