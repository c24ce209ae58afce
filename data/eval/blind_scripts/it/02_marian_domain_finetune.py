"""Domain fine-tuning of an OPUS-MT Marian model (e.g. medical EN->FR).

Corpus BLEU on the dev set is computed from sacrebleu sufficient statistics summed over
ranks, so the score is identical to decoding the whole dev set on one GPU.

Launch:
    torchrun --standalone --nproc_per_node=4 02_marian_domain_finetune.py \
        --train data/emea/train.jsonl --dev data/emea/dev.jsonl --src en --tgt fr
"""
import argparse
import json
import math
import os

import sacrebleu
import torch
import torch.distributed as dist
from sacrebleu.metrics import BLEU
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoTokenizer, DataCollatorForSeq2Seq, MarianMTModel,
                          get_inverse_sqrt_schedule)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Helsinki-NLP/opus-mt-en-fr")
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--src", default="en")
    ap.add_argument("--tgt", default="fr")
    ap.add_argument("--out", default="runs/opus-mt-en-fr-emea")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--num-beams", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=2000)
    ap.add_argument("--fp16", action="store_true")
    return ap.parse_args()


class JsonlPairs(Dataset):
    def __init__(self, path, tok, src, tgt, max_len):
        self.rows = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                ex = json.loads(line)
                self.rows.append((ex[src], ex[tgt]))
        self.tok = tok
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        s, t = self.rows[i]
        enc = self.tok(s, text_target=t, max_length=self.max_len, truncation=True)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "labels": enc["labels"]}


@torch.no_grad()
def dev_bleu(model, tok, dev, args, rank, world, device):
    """Each rank decodes every world-th sentence; BLEU stats are summed across ranks."""
    model.eval()
    idx = list(range(rank, len(dev.rows), world))
    hyps, refs = [], []
    for b in range(0, len(idx), args.eval_batch_size):
        chunk = [dev.rows[i] for i in idx[b : b + args.eval_batch_size]]
        enc = tok([s for s, _ in chunk], return_tensors="pt", padding=True,
                  truncation=True, max_length=args.max_len).to(device)
        out = model.generate(**enc, num_beams=args.num_beams, max_new_tokens=args.max_len)
        hyps.extend(tok.batch_decode(out, skip_special_tokens=True))
        refs.extend(t for _, t in chunk)
    model.train()

    local = sacrebleu.corpus_bleu(hyps, [refs])
    stats = torch.tensor(local.counts + local.totals + [local.sys_len, local.ref_len],
                         dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    stats = stats.long().tolist()
    correct, total = stats[0:4], stats[4:8]
    sys_len, ref_len = stats[8], stats[9]
    return BLEU.compute_bleu(correct, total, sys_len, ref_len, smooth_method="exp").score


def save(model, tok, path):
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = MarianMTModel.from_pretrained(args.model).to(device)
    collator = DataCollatorForSeq2Seq(tok, model=model, label_pad_token_id=-100, pad_to_multiple_of=8)

    train = JsonlPairs(args.train, tok, args.src, args.tgt, args.max_len)
    dev = JsonlPairs(args.dev, tok, args.src, args.tgt, args.max_len)
    sampler = DistributedSampler(train, shuffle=True, seed=1234, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler,
                        collate_fn=collator, num_workers=4, pin_memory=True)

    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optim = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    sched = get_inverse_sqrt_schedule(optim, num_warmup_steps=args.warmup)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    if rank == 0:
        print(f"{len(train)} training pairs, {len(loader)} steps/epoch/rank, world={world}")
    best = dev_bleu(model, tok, dev, args, rank, world, device)
    if rank == 0:
        print(f"BLEU before fine-tuning: {best:.2f}", flush=True)

    step = 0
    running = torch.zeros(2, device=device)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = ddp(**batch).loss
            optim.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optim)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            scaler.step(optim)
            scaler.update()
            sched.step()
            step += 1
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])

            if step % 200 == 0:
                dist.all_reduce(running)
                if rank == 0:
                    avg = (running[0] / running[1]).item()
                    print(f"ep {epoch} step {step} loss {avg:.4f} ppl {math.exp(avg):.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e}", flush=True)
                running.zero_()

            if step % args.eval_every == 0:
                bleu = dev_bleu(model, tok, dev, args, rank, world, device)
                if rank == 0:
                    print(f"step {step} dev BLEU {bleu:.2f} (best {best:.2f})", flush=True)
                    if bleu > best:
                        best = bleu
                        save(model, tok, os.path.join(args.out, "best"))
                dist.barrier()

    if rank == 0:
        save(model, tok, os.path.join(args.out, "last"))
        print(f"done, best dev BLEU {best:.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
