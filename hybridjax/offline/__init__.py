"""The offline trainers: SFT (`sft`) and preference training (`dpo`) over one loop (`loop`)."""
