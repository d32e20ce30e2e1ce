"""Stage 00's side: conversations, chat formatting, self-distillation, the feature cache, training batches."""
