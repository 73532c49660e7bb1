"""Who hands buckets to the hook: DDP's communication hook, FSDP's hooks, DiLoCo's rounds."""
