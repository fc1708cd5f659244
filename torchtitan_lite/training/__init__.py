"""A training step and what it needs.
- step.py: the train and eval step over a local batch, written once; the pipeline schedule's is a second implementation
- preflight.py: the checks a config passes before any process talks to another
- plan.py: what a run will do, said before it does it (`train.py --check`, and rank 0 at start-up)
- optim.py: AdamW, the learning-rate schedule, and gradient clipping across meshes
- optimizers.py: the optimizers by name (optimizer.name), each over the model's parameter groups
- muon.py: Muon, each matrix orthogonalized whole however it is sharded, AdamW on the rest
- z_loss.py: PaLM's z-loss on the output logits, trained and logged apart from the loss, exact on sharded logits
- mtp.py: multi-token prediction's objective (DeepSeek-V3): each depth's shifted targets and loss, logged apart
- update.py: the optimizer step and what acts around it: unscaling, clipping, the votes to skip it, its hooks
- steps.py: the loop's steps, and what happens between two of them (gc, signals, the profiler's step)
- validation.py: the loss on held-out data, the same batches at every validation
- source_losses.py: what a logging step sums beside the loss: the z-loss, MTP's loss, a mixture's loss, tokens and
  epochs per source
- expert_load.py: a mixture of experts' load each step, DeepSeek-V3's bias balancing, its router losses' values
- replicas.py: replica groups (torchft): who is alive each step, their gradients summed, a step committed or retried,
  a restarted group healed from a live one
- replica_state.py: what a group that heals is sent (each rank's local shards), and the digest groups compare
- replica_quorum.py: the quorum ids torchft's Manager is shown, which a restarted lighthouse cannot confuse
- replica_config.py: what a run of replica groups accepts, checked before any process starts; torchft, imported quiet
- replica_writer.py: which group writes the run's folder while its claim holds, and when a new writer saves at once
- layout_invariant.py: every layout the single process's bits: gradients and losses summed in one tree; what
  the mode refuses

May import every layer below it; only tools, train.py and scripts import it.
"""
