"""The engines that hold the model: the interface, the native one (FSDP2/DDP, TP, PP) and DeepSpeed."""
