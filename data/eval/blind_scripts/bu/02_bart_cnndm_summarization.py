"""Fine-tune BART-base on CNN/DailyMail with a hand-written DDP loop.

Launch:
    torchrun --nproc_per_node=4 02_bart_cnndm_summarization.py --out runs/bart_cnndm
"""
import argparse
import json
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_from_disk
from rouge_score import rouge_scorer, scoring
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="facebook/bart-base")
    ap.add_argument("--data", default="data/cnn_dailymail_tok", help="output of datasets.save_to_disk")
    ap.add_argument("--out", default="runs/bart_cnndm")
    ap.add_argument("--max-source-len", type=int, default=1024)
    ap.add_argument("--max-target-len", type=int, default=142)
    ap.add_argument("--per-device-batch", type=int, default=8)
    ap.add_argument("--update-freq", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmup-updates", type=int, default=500)
    ap.add_argument("--total-updates", type=int, default=20000)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=2000)
    ap.add_argument("--eval-samples", type=int, default=2000)
    ap.add_argument("--num-beams", type=int, default=4)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


class IndexedSummaries(Dataset):
    """Wraps a tokenised HF split and returns the row index with each sample."""

    def __init__(self, hf_split):
        self.ds = hf_split

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        row = self.ds[i]
        return i, row["input_ids"], row["labels"], row["highlights"]


def make_collate(pad_id):
    def collate(items):
        idx, src, tgt, refs = zip(*items)
        S = max(len(s) for s in src)
        T = max(len(t) for t in tgt)
        input_ids = torch.full((len(src), S), pad_id, dtype=torch.long)
        labels = torch.full((len(tgt), T), -100, dtype=torch.long)
        for i, (s, t) in enumerate(zip(src, tgt)):
            input_ids[i, : len(s)] = torch.tensor(s)
            labels[i, : len(t)] = torch.tensor(t)
        return {
            "idx": torch.tensor(idx),
            "input_ids": input_ids,
            "attention_mask": input_ids.ne(pad_id).long(),
            "labels": labels,
            "refs": list(refs),
        }
    return collate


def smoothed_loss_sum(logits, labels, eps):
    lprobs = F.log_softmax(logits.float(), dim=-1)
    mask = labels.ne(-100)
    safe = labels.masked_fill(~mask, 0)
    nll = -lprobs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.mean(-1)
    loss = ((1 - eps) * nll + eps * smooth)[mask].sum()
    return loss, nll[mask].sum(), mask.sum()


def lr_lambda(warmup, total):
    def f(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return f


@torch.no_grad()
def evaluate(model, loader, tok, args, device, world_size):
    model.eval()
    local = []
    for batch in loader:
        gen = model.module.generate(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            num_beams=args.num_beams, max_length=args.max_target_len,
            min_length=56, no_repeat_ngram_size=3, length_penalty=2.0, early_stopping=True,
        )
        preds = tok.batch_decode(gen, skip_special_tokens=True, clean_up_tokenization_spaces=True)
        for i, p, r in zip(batch["idx"].tolist(), preds, batch["refs"]):
            local.append((i, p.strip(), r.strip()))

    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    model.train()
    if dist.get_rank() != 0:
        return None

    # DistributedSampler pads with repeated samples; keep one prediction per index
    by_idx = {}
    for part in gathered:
        for i, p, r in part:
            by_idx[i] = (p, r)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeLsum"], use_stemmer=True)
    agg = scoring.BootstrapAggregator()
    for p, r in by_idx.values():
        agg.add_scores(scorer.score("\n".join(r.split(" . ")), "\n".join(p.split(" . "))))
    res = agg.aggregate()
    return {k: round(v.mid.fmeasure * 100, 2) for k, v in res.items()} | {"n": len(by_idx)}


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    is_main = rank == 0

    tok = AutoTokenizer.from_pretrained(args.model)
    data = load_from_disk(args.data)
    train_ds = IndexedSummaries(data["train"])
    val_ds = IndexedSummaries(data["validation"].select(range(args.eval_samples)))
    collate = make_collate(tok.pad_token_id)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=16, sampler=val_sampler, collate_fn=collate, num_workers=2)

    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "layer_norm.weight", "layernorm_embedding.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_updates, args.total_updates))

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    updates, micro, epoch = 0, 0, 0
    log_loss = torch.zeros(2, device=device)
    t0 = time.time()
    model.train()
    while updates < args.total_updates:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            micro += 1
            sync_now = micro % args.update_freq == 0
            ctx = nullcontext() if sync_now else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(input_ids=batch["input_ids"].to(device, non_blocking=True),
                                attention_mask=batch["attention_mask"].to(device, non_blocking=True),
                                labels=batch["labels"].to(device, non_blocking=True))
                loss_sum, nll_sum, ntok = smoothed_loss_sum(out.logits, batch["labels"].to(device), args.label_smoothing)
                # per-token mean over the micro-batches of one update
                (loss_sum / (ntok * args.update_freq)).backward()
            log_loss += torch.stack([nll_sum.detach(), ntok.float()])
            if not sync_now:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            updates += 1

            if updates % 100 == 0:
                dist.all_reduce(log_loss)
                if is_main:
                    nll = (log_loss[0] / log_loss[1]).item()
                    print(f"upd {updates} | nll {nll:.3f} | ppl {math.exp(nll):.2f} | "
                          f"lr {scheduler.get_last_lr()[0]:.2e} | {time.time() - t0:.0f}s", flush=True)
                log_loss.zero_()

            if updates % args.eval_every == 0 or updates == args.total_updates:
                scores = evaluate(model, val_loader, tok, args, device, world_size)
                if is_main:
                    print(f"upd {updates} | valid {scores}", flush=True)
                    ckpt_dir = os.path.join(args.out, f"checkpoint-{updates}")
                    model.module.save_pretrained(ckpt_dir)
                    tok.save_pretrained(ckpt_dir)
                    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                "updates": updates}, os.path.join(ckpt_dir, "trainer_state.pt"))
                dist.barrier()
            if updates >= args.total_updates:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
