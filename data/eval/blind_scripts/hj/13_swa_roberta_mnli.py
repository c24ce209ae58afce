"""SWA fine-tuning of RoBERTa on MNLI, with calibration metrics.

Fine-tune for `epochs` epochs; from `swa_start` on, average the weights at the
end of every epoch (torch.optim.swa_utils.AveragedModel) with a constant LR.
Reports accuracy / NLL / ECE of the last SGD iterate and of the SWA average
on matched and mismatched dev sets.

    torchrun --nproc_per_node=8 13_swa_roberta_mnli.py --model roberta-base --epochs 6 --swa-start 3
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, DistributedSampler
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          get_linear_schedule_with_warmup)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="roberta-base")
    p.add_argument("--out", default="runs/swa_mnli")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--swa-start", type=int, default=3, help="first epoch whose end is averaged")
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--swa-lr", type=float, default=1e-5)
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--n-bins", type=int, default=15)
    return p.parse_args()


def build_data(args, tok, rank, world):
    # rank 0 tokenises and fills the HF cache, the others read it afterwards
    if rank != 0:
        dist.barrier()
    raw = load_dataset("glue", "mnli")

    def enc(b):
        return tok(b["premise"], b["hypothesis"], truncation=True, max_length=args.max_len)

    ds = raw.map(enc, batched=True, remove_columns=["premise", "hypothesis", "idx"])
    ds = ds.rename_column("label", "labels")
    if rank == 0:
        dist.barrier()
    ds.set_format("torch")
    return ds


@torch.no_grad()
def evaluate(model, loader, device, n_bins):
    model.eval()
    s = torch.zeros(3 + 2 * n_bins, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        probs = logits.float().softmax(-1)
        y = batch["labels"]
        conf, pred = probs.max(-1)
        hit = pred.eq(y).double()
        b = (conf * n_bins).long().clamp(max=n_bins - 1)
        s[0] += y.numel()
        s[1] += hit.sum()
        s[2] += F.cross_entropy(logits.float(), y, reduction="sum")
        s[3:3 + n_bins].index_add_(0, b, conf.double())
        s[3 + n_bins:].index_add_(0, b, hit)
    dist.all_reduce(s)
    n = s[0]
    ece = (s[3:3 + n_bins] - s[3 + n_bins:]).abs().sum() / n
    return {"acc": (s[1] / n).item(), "nll": (s[2] / n).item(), "ece": ece.item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(13)

    tok = AutoTokenizer.from_pretrained(args.model)
    ds = build_data(args, tok, rank, world)
    collate = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(ds["train"], num_replicas=world, rank=rank, shuffle=True, seed=13)
    train_loader = DataLoader(ds["train"], batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, pin_memory=True)
    dev_loaders = {
        split: DataLoader(ds[split].shard(num_shards=world, index=rank, contiguous=False),
                          batch_size=128, collate_fn=collate, num_workers=2)
        for split in ("validation_matched", "validation_mismatched")
    }

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=3).to(device)
    swa_model = AveragedModel(model)  # copy before DDP registers its hooks
    ddp = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    # linear decay until swa_start, constant swa_lr afterwards
    pre_swa_steps = args.swa_start * len(train_loader)
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * pre_swa_steps), pre_swa_steps)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        ddp.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            step += 1
            if epoch < args.swa_start:
                sched.step()
            else:
                for g in opt.param_groups:
                    g["lr"] = args.swa_lr
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.2e}",
                      flush=True)

        if epoch + 1 >= args.swa_start:
            swa_model.update_parameters(model)

        res = {split: evaluate(model, dl, device, args.n_bins) for split, dl in dev_loaders.items()}
        if swa_model.n_averaged.item() > 0:
            res.update({f"swa_{split}": evaluate(swa_model, dl, device, args.n_bins)
                        for split, dl in dev_loaders.items()})
        if rank == 0:
            for k, v in res.items():
                print(f"[epoch {epoch}] {k:28s} acc {v['acc']:.4f} nll {v['nll']:.4f} ece {v['ece']:.4f}",
                      flush=True)
            torch.save({"model": model.state_dict(), "swa": swa_model.module.state_dict(),
                        "n_averaged": swa_model.n_averaged.item(), "epoch": epoch, "metrics": res},
                       os.path.join(args.out, "checkpoint.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
