"""A Hugging Face encoder fine-tuned with gradient checkpointing, wrapped by
hand in DDP with find_unused_parameters=True because its pooler is unused.

torchrun --nproc_per_node=4 hf_gradient_checkpointing_with_unused_parameters.py
gradient_checkpointing_enable() with no kwargs checkpoints reentrantly
(transformers 4.x), which DDP's unused-parameter search cannot follow.
Lint only: it needs the model from the Hub and GPUs.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForTokenClassification


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = AutoModelForTokenClassification.from_pretrained("bert-base-cased", num_labels=9)
    model.gradient_checkpointing_enable()  # expect: ddp-reentrant-checkpoint
    model = DDP(model.cuda(), device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    batch = {
        "input_ids": torch.randint(0, 1000, (4, 64)).cuda(),
        "labels": torch.randint(0, 9, (4, 64)).cuda(),
    }
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
