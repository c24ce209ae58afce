"""Domain fine-tuning of a pretrained Marian MT model (e.g. Helsinki-NLP/opus-mt-en-de) on in-domain bitext.

    torchrun --nproc_per_node=4 15_marian_finetune_bleu.py --model Helsinki-NLP/opus-mt-en-de \
        --train data/med/train.jsonl --dev data/med/dev.jsonl --out exp/marian_med
"""
import argparse
import contextlib
import json
import os
import time

import sacrebleu
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoTokenizer, MarianMTModel, get_inverse_sqrt_schedule


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Helsinki-NLP/opus-mt-en-de")
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--update-freq", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--patience", type=int, default=2)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=256)
    return ap.parse_args()


def load_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(l) for l in f if l.strip()]


def make_collate(tok, max_len):
    def collate(rows):
        enc = tok([r["src"] for r in rows], text_target=[r["tgt"] for r in rows], max_length=max_len,
                  truncation=True, padding=True, return_tensors="pt")
        enc["labels"][enc["labels"] == tok.pad_token_id] = -100
        enc["refs"] = [r["tgt"] for r in rows]
        return enc
    return collate


@torch.no_grad()
def corpus_bleu_distributed(model, loader, tok, device, beam, rank, world):
    model.eval()
    hyps, refs = [], []
    for batch in loader:
        out = model.generate(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                             num_beams=beam, max_new_tokens=256)
        hyps += tok.batch_decode(out, skip_special_tokens=True)
        refs += batch["refs"]
    model.train()
    parts = [None] * world
    dist.all_gather_object(parts, (hyps, refs))
    score = [None]
    if rank == 0:
        H = [h for p in parts for h in p[0]]
        R = [r for p in parts for r in p[1]]
        score[0] = sacrebleu.corpus_bleu(H, [R]).score
    dist.broadcast_object_list(score, src=0)
    return score[0]


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    # let rank 0 populate the HF cache first
    if rank != 0:
        dist.barrier()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = MarianMTModel.from_pretrained(args.model)
    if rank == 0:
        dist.barrier()

    collate = make_collate(tok, args.max_len)
    train_rows, dev_rows = load_jsonl(args.train), load_jsonl(args.dev)
    train_sampler = DistributedSampler(train_rows, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_rows, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=2, drop_last=True)
    dev_loader = DataLoader(Subset(dev_rows, range(rank, len(dev_rows), world)), batch_size=32, collate_fn=collate)

    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = get_inverse_sqrt_schedule(optimizer, num_warmup_steps=args.warmup)
    scaler = torch.cuda.amp.GradScaler()

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    bleu0 = corpus_bleu_distributed(model, dev_loader, tok, device, args.beam, rank, world)
    if rank == 0:
        print(f"baseline dev BLEU {bleu0:.2f}", flush=True)
    best, bad, updates = bleu0, 0, 0
    steps_per_epoch = len(train_loader)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            batch.pop("refs")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last_micro = (i + 1) % args.update_freq == 0 or (i + 1) == steps_per_epoch
            with (contextlib.nullcontext() if last_micro else ddp_model.no_sync()):
                with torch.cuda.amp.autocast():
                    loss = ddp_model(**batch).loss
                scaler.scale(loss / args.update_freq).backward()
            if not last_micro:
                continue
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            updates += 1
            if writer is not None and updates % 25 == 0:
                writer.add_scalar("train/loss", loss.item(), updates)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], updates)

        bleu = corpus_bleu_distributed(model, dev_loader, tok, device, args.beam, rank, world)
        if rank == 0:
            print(f"epoch {epoch} updates {updates} dev BLEU {bleu:.2f} ({time.time() - t0:.0f}s)", flush=True)
            writer.add_scalar("dev/bleu", bleu, epoch)
        if bleu > best:
            best, bad = bleu, 0
            if rank == 0:
                model.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
        else:
            bad += 1
        dist.barrier()
        if bad >= args.patience:
            break

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
