"""A QLoRA fine-tune launched with torchrun that keeps a single-GPU recipe's
device_map={"": 0} (hardcoded-device).

Every one of the N processes loads its 4-bit copy onto GPU 0, which runs out of
memory, while each process's batches and DDP's device_ids name its own GPU.
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
        "mistralai/Mistral-7B-v0.1",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        device_map={"": 0},  # expect: hardcoded-device
    )
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
