"""Distributed evaluation of a seq2seq model that gathers what each rank
generated, and a token tagger that gathers each batch's labels, into
buffers shaped like the local tensor.

generate() stops at this rank's longest answer, and the collator pads each
batch to its own longest sentence: the lengths differ across ranks while
every rank receives into buffers like its own.
"""

import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoModelForTokenClassification
from transformers import AutoTokenizer, DataCollatorForTokenClassification


@torch.no_grad()
def translate_all(model, loader, device, world_size):
    outputs = []
    for batch in loader:
        gen = model.generate(input_ids=batch["input_ids"].to(device), max_new_tokens=64)
        parts = [torch.zeros_like(gen) for _ in range(world_size)]
        dist.all_gather(parts, gen)  # expect: collective-mismatch
        outputs.extend(parts)
    return outputs


def gather(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)  # expect: collective-mismatch
    return torch.cat(out)


@torch.no_grad()
def tag_all(model, loader, device):
    tags = []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        tags.append(gather(batch["labels"]))
    return tags


def main():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    tok = AutoTokenizer.from_pretrained("t5-small")
    dev = torch.load("dev.pt")
    sampler = DistributedSampler(dev, shuffle=False)
    loader = DataLoader(dev, batch_size=32, sampler=sampler, collate_fn=lambda b: tok.pad(b))
    seq2seq = AutoModelForSeq2SeqLM.from_pretrained("t5-small").to(device)
    translate_all(seq2seq, loader, device, dist.get_world_size())
    tagger = AutoModelForTokenClassification.from_pretrained("bert-base-cased").to(device)
    tagged = DataLoader(dev, batch_size=32, sampler=sampler,
                        collate_fn=DataCollatorForTokenClassification(tok))
    tag_all(tagger, tagged, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
