"""A QLoRA fine-tune launched with torchrun that loads its model with
device_map="auto" (device-map-with-ddp).

Each of the N processes spreads its own 4-bit copy over all N GPUs; DDP then
rejects a module on several devices ("DistributedDataParallel device_ids and
output_device arguments only work with single-device/multiple-device GPU
modules or CPU modules, but got device_ids [1], output_device 1, and module
parameters {device(type='cuda', index=0), device(type='cuda', index=1)}").
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM, BitsAndBytesConfig


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = AutoModelForCausalLM.from_pretrained(
        "meta-llama/Llama-3.2-1B",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        device_map="auto",  # expect: device-map-with-ddp
    )
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
