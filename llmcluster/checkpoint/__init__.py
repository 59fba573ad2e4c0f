"""Checkpoints as one room: the atomic DCP write and its marker (checkpointer), verification before a
checkpoint is chosen (verify), data-only loading (safe_load; its DCP reader in safe_reader, imported on a read only), pinned host staging for async saves (staging), the run's
one-writer lock (ownership), the RNG state saved with each step (rng) and the run's fingerprint, checked before a
resume loads anything (fingerprint, pure Python: the CLI checks it before torch starts), and the base of an NF4
(QLoRA) run, which its checkpoints leave out: the trainer and the export read it from train.init_from by the same
rules (nf4_base). Imported by train, export and eval; imports no training loop (docs/architecture.md)."""
