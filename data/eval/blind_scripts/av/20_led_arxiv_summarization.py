"""Long-document summarization (arXiv) with LED-base-16384, hand-written DDP loop.

    torchrun --nproc_per_node=8 20_led_arxiv_summarization.py --out runs/led_arxiv --max_source_len 8192
"""
import argparse
import contextlib
import json
import math
import os
import time

import nltk
import torch
import torch.distributed as dist
from datasets import load_dataset
from rouge_score import rouge_scorer, scoring
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, LEDForConditionalGeneration, get_linear_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="allenai/led-base-16384")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_source_len", type=int, default=8192)
    ap.add_argument("--max_target_len", type=int, default=512)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--eval_samples", type=int, default=1000)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def build_collate(tok, max_src, max_tgt):
    def collate(rows):
        enc = tok([r["article"] for r in rows], max_length=max_src, truncation=True, padding="longest",
                  pad_to_multiple_of=1024, return_tensors="pt")
        lab = tok(text_target=[r["abstract"] for r in rows], max_length=max_tgt, truncation=True,
                  padding="longest", return_tensors="pt")["input_ids"]
        lab[lab == tok.pad_token_id] = -100
        gam = torch.zeros_like(enc["input_ids"])
        gam[:, 0] = 1  # global attention on <s>
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "global_attention_mask": gam, "labels": lab, "idx": torch.tensor([r["idx"] for r in rows])}
    return collate


def generate_summaries(model, loader, tok, num_beams=4, max_len=512, device="cuda:0"):
    model.eval()
    out = []
    with torch.no_grad():
        for batch in loader:
            gen = model.generate(input_ids=batch["input_ids"].to(device),
                                 attention_mask=batch["attention_mask"].to(device),
                                 global_attention_mask=batch["global_attention_mask"].to(device),
                                 num_beams=num_beams, max_length=max_len, length_penalty=2.0,
                                 no_repeat_ngram_size=3, early_stopping=True)
            out += list(zip(batch["idx"].tolist(), tok.batch_decode(gen, skip_special_tokens=True)))
    model.train()
    return out


def rouge(preds, refs):
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeLsum"], use_stemmer=True)
    agg = scoring.BootstrapAggregator()
    for p, r in zip(preds, refs):
        agg.add_scores(scorer.score("\n".join(nltk.sent_tokenize(r)), "\n".join(nltk.sent_tokenize(p))))
    return {k: round(100 * v.mid.fmeasure, 2) for k, v in agg.aggregate().items()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if rank != 0:
        dist.barrier()  # let rank 0 download and prepare the arrow cache first
    ds = load_dataset("scientific_papers", "arxiv")
    if rank == 0:
        dist.barrier()
    train = ds["train"].add_column("idx", list(range(len(ds["train"]))))
    val = ds["validation"].select(range(args.eval_samples))
    val = val.add_column("idx", list(range(len(val))))
    collate = build_collate(tok, args.max_source_len, args.max_target_len)

    sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_shard = Subset(val, list(range(rank, len(val), world)))
    val_loader = DataLoader(val_shard, batch_size=4, collate_fn=collate, num_workers=2)

    model = LEDForConditionalGeneration.from_pretrained(args.model)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates = math.ceil(len(loader) / args.grad_accum) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup, updates)

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_r2 = -1.0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for step, batch in enumerate(loader):
            batch.pop("idx")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (step + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not last_micro else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss
                (loss / args.grad_accum).backward()
            run += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
        dist.all_reduce(run)

        with torch.autocast("cuda", dtype=torch.bfloat16):
            local = generate_summaries(model.module, val_loader, tok, args.beams, args.max_target_len)
        parts = [None] * world
        dist.all_gather_object(parts, local)
        if rank == 0:
            preds = dict(p for part in parts for p in part)
            scores = rouge([preds[i] for i in range(len(val))], val["abstract"])
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.4f} {scores} ({time.time() - t0:.0f}s)", flush=True)
            with open(os.path.join(args.out, "val_scores.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, **scores}) + "\n")
            if scores["rouge2"] > best_r2:
                best_r2 = scores["rouge2"]
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
