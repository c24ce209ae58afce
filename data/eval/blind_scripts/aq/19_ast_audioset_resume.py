"""Fine-tune the Audio Spectrogram Transformer (AST, ImageNet+AudioSet init) on AudioSet-20K / full.

torchrun --nproc_per_node=4 19_ast_audioset_resume.py --train_json data/as20k_train.json \
    --eval_json data/as_eval.json --label_csv data/class_labels_indices.csv --exp exp/ast_as20k
# resume:
torchrun --nproc_per_node=4 19_ast_audioset_resume.py ... --resume exp/ast_as20k/last.pth
"""
import argparse
import csv
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import ASTForAudioClassification

AST_MEAN, AST_STD = -4.2677393, 4.5689974


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train_json", required=True)
    p.add_argument("--eval_json", required=True)
    p.add_argument("--label_csv", required=True)
    p.add_argument("--exp", required=True)
    p.add_argument("--init", default="MIT/ast-finetuned-audioset-10-10-0.4593")
    p.add_argument("--bs", type=int, default=12)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--lr_decay_start", type=int, default=10)
    p.add_argument("--mixup", type=float, default=0.5)
    p.add_argument("--freqm", type=int, default=48)
    p.add_argument("--timem", type=int, default=192)
    p.add_argument("--resume", default=None)
    return p.parse_args()


class ASDataset(Dataset):
    def __init__(self, json_path, label_csv, train, freqm=0, timem=0, target_len=1024):
        with open(json_path) as f:
            self.data = json.load(f)["data"]
        with open(label_csv) as f:
            self.idx = {r["mid"]: int(r["index"]) for r in csv.DictReader(f)}
        self.n_class = len(self.idx)
        self.train, self.target_len = train, target_len
        self.fm = torchaudio.transforms.FrequencyMasking(freqm) if freqm else None
        self.tm = torchaudio.transforms.TimeMasking(timem) if timem else None

    def __len__(self):
        return len(self.data)

    def _fbank(self, path):
        wav, sr = torchaudio.load(path)
        wav = wav - wav.mean()
        fb = torchaudio.compliance.kaldi.fbank(wav, htk_compat=True, sample_frequency=sr, use_energy=False,
                                               window_type="hanning", num_mel_bins=128, dither=0.0,
                                               frame_shift=10)
        n = fb.size(0)
        if n < self.target_len:
            fb = F.pad(fb, (0, 0, 0, self.target_len - n))
        return fb[: self.target_len]

    def __getitem__(self, i):
        item = self.data[i]
        fb = self._fbank(item["wav"])
        label = torch.zeros(self.n_class)
        for mid in item["labels"].split(","):
            label[self.idx[mid]] = 1.0
        if self.train:
            fb = fb.T.unsqueeze(0)
            if self.fm is not None:
                fb = self.fm(fb)
            if self.tm is not None:
                fb = self.tm(fb)
            fb = fb.squeeze(0).T
        return (fb - AST_MEAN) / (AST_STD * 2), label


@torch.no_grad()
def validate(model, loader, device, world, n_total):
    model.eval()
    outs, tgts = [], []
    for x, y in loader:
        outs.append(torch.sigmoid(model(x.to(device)).logits))
        tgts.append(y.to(device))
    outs, tgts = torch.cat(outs), torch.cat(tgts)
    go = [torch.empty_like(outs) for _ in range(world)]
    gt = [torch.empty_like(tgts) for _ in range(world)]
    dist.all_gather(go, outs)
    dist.all_gather(gt, tgts)
    outs = torch.stack(go, 1).flatten(0, 1)[:n_total].cpu().numpy()
    tgts = torch.stack(gt, 1).flatten(0, 1)[:n_total].cpu().numpy()
    model.train()
    valid = tgts.sum(0) > 0
    mAP = average_precision_score(tgts[:, valid], outs[:, valid], average="macro")
    auc = roc_auc_score(tgts[:, valid], outs[:, valid], average="macro")
    return mAP, auc


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_set = ASDataset(args.train_json, args.label_csv, True, args.freqm, args.timem)
    eval_set = ASDataset(args.eval_json, args.label_csv, False)
    tr_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.bs, sampler=tr_sampler, num_workers=8, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_set, args.bs * 2, sampler=DistributedSampler(eval_set, shuffle=False),
                             num_workers=8, pin_memory=True)

    model = ASTForAudioClassification.from_pretrained(args.init, num_labels=train_set.n_class,
                                                      ignore_mismatched_sizes=True).to(device)
    head = [p for n, p in model.named_parameters() if n.startswith("classifier")]
    body = [p for n, p in model.named_parameters() if not n.startswith("classifier")]
    opt = torch.optim.Adam([{"params": body, "lr": args.lr}, {"params": head, "lr": args.lr * 100}],
                           weight_decay=5e-7, betas=(0.95, 0.999))
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, list(range(args.lr_decay_start, 1000)), gamma=0.5)

    start_epoch, best_map = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best_map = ckpt["epoch"] + 1, ckpt["best_map"]
        del ckpt

    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if args.mixup > 0 and np.random.rand() < args.mixup:
                lam = float(np.random.beta(10, 10))
                perm = torch.randperm(x.size(0), device=device)
                x = lam * x + (1 - lam) * x[perm]
                y = lam * y + (1 - lam) * y[perm]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x).logits
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
            if i % 200 == 0 and rank == 0:
                print(f"epoch {epoch} it {i}/{len(train_loader)} loss {loss.item():.5f}", flush=True)
        sched.step()
        dist.all_reduce(run)
        mAP, auc = validate(model, eval_loader, device, world, len(eval_set))
        if rank == 0:
            print(f"epoch {epoch} train_loss {(run[0] / run[1]).item():.5f} mAP {mAP:.4f} AUC {auc:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            best_map = max(best_map, mAP)
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "epoch": epoch, "best_map": best_map}
            torch.save(state, os.path.join(args.exp, "last.pth"))
            if mAP >= best_map:
                torch.save(model.module.state_dict(), os.path.join(args.exp, "best_model.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
