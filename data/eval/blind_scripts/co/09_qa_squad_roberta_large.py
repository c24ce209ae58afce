#!/usr/bin/env python
"""RoBERTa-large on SQuAD v1.1 -- torchrun/DDP, bf16 autocast, dynamic padding.

    torchrun --nproc_per_node=8 09_qa_squad_roberta_large.py --output_dir out/rl-squad1
    # resume
    torchrun --nproc_per_node=8 09_qa_squad_roberta_large.py --output_dir out/rl-squad1 --resume out/rl-squad1/last.pt
"""
import argparse
import collections
import logging
import os

import evaluate
import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="roberta-large")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--max_len", type=int, default=384)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=6)
    ap.add_argument("--eval_batch_size", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1.5e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup_ratio", type=float, default=0.06)
    ap.add_argument("--n_best", type=int, default=20)
    ap.add_argument("--max_answer_len", type=int, default=30)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def prep_train(ex, tokenizer, args):
    enc = tokenizer([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second",
                    max_length=args.max_len, stride=args.stride,
                    return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    starts, ends = [], []
    for i, offsets in enumerate(enc.pop("offset_mapping")):
        seq = enc.sequence_ids(i)
        answer = ex["answers"][smap[i]]
        a_start = answer["answer_start"][0]
        a_end = a_start + len(answer["text"][0])
        c0 = seq.index(1)
        c1 = len(seq) - 1 - seq[::-1].index(1)
        if offsets[c0][0] > a_start or offsets[c1][1] < a_end:
            starts.append(0)
            ends.append(0)
            continue
        i0 = c0
        while i0 <= c1 and offsets[i0][0] <= a_start:
            i0 += 1
        i1 = c1
        while i1 >= c0 and offsets[i1][1] >= a_end:
            i1 -= 1
        starts.append(i0 - 1)
        ends.append(i1 + 1)
    enc["start_positions"] = starts
    enc["end_positions"] = ends
    return enc


def prep_eval(ex, tokenizer, args):
    enc = tokenizer([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second",
                    max_length=args.max_len, stride=args.stride,
                    return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    enc["example_id"] = [ex["id"][j] for j in smap]
    for i in range(len(enc["input_ids"])):
        seq = enc.sequence_ids(i)
        enc["offset_mapping"][i] = [o if seq[k] == 1 else None for k, o in enumerate(enc["offset_mapping"][i])]
    return enc


def gather_padded(t, pad_value):
    """all_gather for [B, L] tensors whose B and L differ between ranks (dynamic padding)."""
    world = dist.get_world_size()
    shape = torch.tensor(t.shape, device=t.device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    max_b = max(int(s[0]) for s in shapes)
    max_l = max(int(s[1]) for s in shapes)
    padded = t.new_full((max_b, max_l), pad_value)
    padded[: t.shape[0], : t.shape[1]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return [o[: int(s[0]), : int(s[1])] for o, s in zip(out, shapes)]


@torch.no_grad()
def collect_logits(model, loader, device):
    model.eval()
    results = {}
    for batch in loader:
        fidx = batch.pop("feature_idx").to(device)
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        starts = gather_padded(out.start_logits.float(), -1e4)
        ends = gather_padded(out.end_logits.float(), -1e4)
        idxs = gather_padded(fidx.unsqueeze(1), -1)
        for s, e, i in zip(starts, ends, idxs):
            for row_s, row_e, row_i in zip(s.cpu().numpy(), e.cpu().numpy(), i[:, 0].tolist()):
                results[row_i] = (row_s, row_e)
    model.train()
    return results


def postprocess(examples, features, logits, args):
    per_ex = collections.defaultdict(list)
    for i, eid in enumerate(features["example_id"]):
        per_ex[eid].append(i)
    preds = []
    for ex in examples:
        best, best_score = "", float("-inf")
        for fi in per_ex[ex["id"]]:
            s_log, e_log = logits[fi]
            offsets = features[fi]["offset_mapping"]
            for s in np.argsort(s_log)[-1: -args.n_best - 1: -1]:
                for e in np.argsort(e_log)[-1: -args.n_best - 1: -1]:
                    if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > args.max_answer_len:
                        continue
                    if s_log[s] + e_log[e] > best_score:
                        best_score = s_log[s] + e_log[e]
                        best = ex["context"][offsets[s][0]: offsets[e][1]]
        preds.append({"id": ex["id"], "prediction_text": best})
    return preds


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    raw = load_dataset("squad")
    if rank != 0:
        dist.barrier()
    train_ds = raw["train"].map(prep_train, batched=True, remove_columns=raw["train"].column_names,
                                fn_kwargs={"tokenizer": tokenizer, "args": args}, num_proc=8)
    dev_feats = raw["validation"].map(prep_eval, batched=True, remove_columns=raw["validation"].column_names,
                                      fn_kwargs={"tokenizer": tokenizer, "args": args}, num_proc=8)
    if rank == 0:
        dist.barrier()
    dev_ds = dev_feats.remove_columns(["example_id", "offset_mapping"])
    dev_ds = dev_ds.add_column("feature_idx", list(range(len(dev_ds))))

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collator,
                          num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev_ds, batch_size=args.eval_batch_size, sampler=DistributedSampler(dev_ds, shuffle=False),
                        collate_fn=collator, num_workers=4)

    model = AutoModelForQuestionAnswering.from_pretrained(args.model_name).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    total_steps = args.epochs * len(train_dl)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        logger.info("resumed at epoch %d", start_epoch)

    metric = evaluate.load("squad")
    os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                logger.info("ep %d | %d/%d | loss %.4f", epoch, step, len(train_dl), loss.item())

        logits = collect_logits(model, dev_dl, device)
        if rank == 0:
            preds = postprocess(raw["validation"], dev_feats, logits, args)
            refs = [{"id": ex["id"], "answers": ex["answers"]} for ex in raw["validation"]]
            res = metric.compute(predictions=preds, references=refs)
            logger.info("ep %d | dev EM %.2f F1 %.2f", epoch, res["exact_match"], res["f1"])
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, "last.pt"))
            model.module.save_pretrained(os.path.join(args.output_dir, f"hf-epoch{epoch}"))
            tokenizer.save_pretrained(os.path.join(args.output_dir, f"hf-epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
