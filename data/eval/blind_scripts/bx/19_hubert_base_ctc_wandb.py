"""HuBERT-Base CTC fine-tuning on TIMIT-style phone targets, tracked in Weights & Biases.

Phone inventory comes from a fixed phones.txt (61 -> 39 folding done at scoring time).

    torchrun --nproc_per_node=4 19_hubert_base_ctc_wandb.py --data data/timit --run_name hubert_base_per
"""
import argparse
import os
import random
import time

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torchaudio
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import HubertForCTC


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/timit")
    p.add_argument("--pretrained", default="facebook/hubert-base-ls960")
    p.add_argument("--run_name", default="hubert_base_per")
    p.add_argument("--project", default="asr-phone-recognition")
    p.add_argument("--out", default="exp/hubert_base_per")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--head_lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_phones(path):
    phones = [l.split()[0] for l in open(path) if l.strip()]
    return {p: i + 1 for i, p in enumerate(phones)}           # 0 = blank


def load_fold(path):
    fold = {}
    for line in open(path):
        parts = line.split()
        fold[parts[0]] = parts[1] if len(parts) > 1 else None
    return fold


class PhoneSet(Dataset):
    def __init__(self, list_path, phone2id):
        self.items = []
        for line in open(list_path):
            wav, phones = line.rstrip("\n").split("\t")
            self.items.append((wav, phones.split()))
        self.p2i = phone2id

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        wav, phones = self.items[i]
        x, sr = torchaudio.load(wav)
        x = x[0]
        x = (x - x.mean()) / (x.std() + 1e-7)
        return x, torch.tensor([self.p2i[p] for p in phones]), phones


def collate(batch):
    xs, ys, ps = zip(*batch)
    x = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
    y = torch.nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=-100)
    return x, y, list(ps)


def per(model, loader, id2phone, fold, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, _, refs in loader:
            pred = model(x.to(device)).logits.argmax(-1)
            for seq, ref in zip(pred, refs):
                hyp = [id2phone[t] for t in torch.unique_consecutive(seq).tolist() if t != 0]
                hyp = [fold.get(p, p) for p in hyp if fold.get(p, p)]
                ref = [fold.get(p, p) for p in ref if fold.get(p, p)]
                hyp = [p for i, p in enumerate(hyp) if i == 0 or p != hyp[i - 1]]
                acc[0] += editdistance.eval(hyp, ref)
                acc[1] += len(ref)
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    wandb.init(project=args.project, name=args.run_name, config=vars(args))

    phone2id = load_phones(os.path.join(args.data, "phones.txt"))
    id2phone = {i: p for p, i in phone2id.items()}
    fold = load_fold(os.path.join(args.data, "phones.61-39.map"))
    train_set = PhoneSet(os.path.join(args.data, "train.tsv"), phone2id)
    dev_set = PhoneSet(os.path.join(args.data, "dev.tsv"), phone2id)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True, seed=args.seed)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(Subset(dev_set, range(rank, len(dev_set), world)), batch_size=16,
                        collate_fn=collate, num_workers=2)

    model = HubertForCTC.from_pretrained(args.pretrained, vocab_size=len(phone2id) + 1, pad_token_id=0,
                                         ctc_loss_reduction="mean", ctc_zero_infinity=True,
                                         layerdrop=0.0, mask_time_prob=0.05)
    model.freeze_feature_encoder()
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    head = [p for n, p in model.module.named_parameters() if n.startswith("lm_head")]
    body = [p for n, p in model.module.named_parameters() if not n.startswith("lm_head") and p.requires_grad]
    opt = torch.optim.AdamW([{"params": body, "lr": args.lr}, {"params": head, "lr": args.head_lr}])
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr, args.head_lr], total_steps=total,
                                                pct_start=0.1)

    best = float("inf")
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y, _ in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, labels=y).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0:
                wandb.log({"train/loss": loss.item(), "train/grad_norm": gnorm.item(),
                           "train/lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        dev_per = per(model.module, dev_dl, id2phone, fold, device)
        wandb.log({"dev/PER": dev_per, "epoch_time_s": time.time() - t0}, step=step)
        if rank == 0:
            print(f"epoch {epoch} dev PER {100 * dev_per:.2f}", flush=True)
            if dev_per < best:
                best = dev_per
                model.module.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
