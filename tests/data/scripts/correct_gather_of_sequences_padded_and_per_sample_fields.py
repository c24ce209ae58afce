"""Distributed evaluation that gathers the right way: generated sequences
padded to a length every rank shares before the gather (Accelerate's
pad_across_processes, or F.pad by the difference with max_new_tokens);
a classifier's per-sample labels and predictions concatenated over the
batches of a DistributedSampler's loader (which pads every rank to the
same count, whichever rows the fold kept), even though the collator pads
each batch to its longest sentence; and an inference pass that logs how
many rows each rank wrote, naming the rank, before rank 0 merges the files."""

import json
import logging
import os

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoModelForSequenceClassification
from transformers import AutoTokenizer

logger = logging.getLogger(__name__)
MAX_NEW = 64


@torch.no_grad()
def translate_padded(model, loader, device, world_size, pad_id):
    outputs = []
    for batch in loader:
        gen = model.generate(input_ids=batch["input_ids"].to(device), max_new_tokens=MAX_NEW)
        gen = F.pad(gen, (0, MAX_NEW + 1 - gen.shape[1]), value=pad_id)
        parts = [torch.zeros_like(gen) for _ in range(world_size)]
        dist.all_gather(parts, gen)
        outputs.extend(parts)
    return outputs


@torch.no_grad()
def translate_accelerate(accelerator, model, loader, pad_id):
    outputs = []
    for batch in loader:
        gen = accelerator.unwrap_model(model).generate(input_ids=batch["input_ids"])
        gen = accelerator.pad_across_processes(gen, dim=1, pad_index=pad_id)
        parts = [torch.zeros_like(gen) for _ in range(accelerator.num_processes)]
        dist.all_gather(parts, gen)
        outputs.extend(parts)
    return outputs


@torch.no_grad()
def classify(model, loader, device, world_size):
    preds, golds = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        preds.append(model(**batch).logits.argmax(-1))
        golds.append(batch["labels"])
    local = torch.stack([torch.cat(preds), torch.cat(golds)])
    everyone = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local)
    return torch.cat(everyone, dim=1)


@torch.no_grad()
def write_predictions(model, loader, device, rank, out_dir):
    n_written = 0
    with open(os.path.join(out_dir, f"part-{rank:05d}.jsonl"), "w") as f:
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            for p in model(**batch).logits.argmax(-1).tolist():
                f.write(json.dumps({"pred": p}) + "\n")
                n_written += 1
    logger.info("rank %d wrote %d predictions", rank, n_written)


def main():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tok = AutoTokenizer.from_pretrained("bert-base-cased")
    df = pd.read_json("dev.jsonl", lines=True)
    fold = df[df.fold != 0].to_dict("records")

    def collate(rows):
        enc = tok([r["text"] for r in rows], padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor([r["label"] for r in rows])
        return enc

    loader = DataLoader(fold, batch_size=64, sampler=DistributedSampler(fold, shuffle=False),
                        collate_fn=collate)
    seq2seq = AutoModelForSeq2SeqLM.from_pretrained("t5-small").to(device)
    translate_padded(seq2seq, loader, device, world_size, tok.pad_token_id)
    accelerator = Accelerator()
    prepared, prepared_loader = accelerator.prepare(seq2seq, loader)
    translate_accelerate(accelerator, prepared, prepared_loader, tok.pad_token_id)
    classifier = AutoModelForSequenceClassification.from_pretrained("bert-base-cased").to(device)
    both = classify(classifier, loader, device, world_size)
    os.makedirs("preds", exist_ok=True)
    write_predictions(classifier, loader, device, rank, "preds")
    dist.barrier()
    if rank == 0:
        print("accuracy", (both[0] == both[1]).float().mean().item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
