"""Shared Conformer audio encoder trained on several audio datasets at once.

Tasks are picked from a registry on the command line, e.g.
    torchrun --nproc_per_node=8 12_audio_multitask_conformer.py \
        --tasks audioset,voxceleb,speechcommands,crema --manifest_dir /data/audio/manifests

Round-robin over the active tasks, one batch per step.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

SR = 16000

TASK_REGISTRY = {
    "audioset": {"n_out": 527, "multilabel": True, "clip_s": 10.0},
    "voxceleb": {"n_out": 1251, "multilabel": False, "clip_s": 4.0},
    "speechcommands": {"n_out": 35, "multilabel": False, "clip_s": 1.0},
    "crema": {"n_out": 6, "multilabel": False, "clip_s": 3.0},
    "esc50": {"n_out": 50, "multilabel": False, "clip_s": 5.0},
}


class ManifestAudio(Dataset):
    """jsonl manifest: {"path": ..., "labels": [int, ...]}"""

    def __init__(self, manifest, n_out, multilabel, clip_s, train):
        with open(manifest) as f:
            self.items = [json.loads(l) for l in f]
        self.n_out, self.multilabel, self.train = n_out, multilabel, train
        self.n = int(clip_s * SR)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        wav, sr = torchaudio.load(it["path"])
        if sr != SR:
            wav = torchaudio.functional.resample(wav, sr, SR)
        wav = wav.mean(0)
        if wav.numel() >= self.n:
            off = torch.randint(0, wav.numel() - self.n + 1, ()).item() if self.train else 0
            wav = wav[off:off + self.n]
        else:
            wav = F.pad(wav, (0, self.n - wav.numel()))
        if self.multilabel:
            y = torch.zeros(self.n_out)
            y[it["labels"]] = 1.0
        else:
            y = torch.tensor(it["labels"][0])
        return wav, y


class AudioMTL(nn.Module):
    def __init__(self, heads, d_model=256, layers=12):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=400, hop_length=160, n_mels=80)
        self.subsample = nn.Sequential(nn.Conv2d(1, 64, 3, 2), nn.ReLU(), nn.Conv2d(64, 64, 3, 2), nn.ReLU())
        self.proj = nn.Linear(64 * 19, d_model)
        self.encoder = torchaudio.models.Conformer(input_dim=d_model, num_heads=4, ffn_dim=1024,
                                                   num_layers=layers, depthwise_conv_kernel_size=31)
        self.heads = nn.ModuleDict()
        for name, n_out in heads.items():
            self.heads[name] = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, n_out))

    def forward(self, wav, task):
        with torch.no_grad():
            x = (self.mel(wav) + 1e-6).log()  # B x 80 x T
        x = self.subsample(x.unsqueeze(1))  # B x 64 x 19 x T'
        b, c, f, t = x.shape
        x = self.proj(x.permute(0, 3, 1, 2).reshape(b, t, c * f))
        lengths = torch.full((b,), t, device=x.device, dtype=torch.long)
        x, _ = self.encoder(x, lengths)
        return self.heads[task](x.mean(1))


def task_loss(task, logits, y):
    if TASK_REGISTRY[task]["multilabel"]:
        return F.binary_cross_entropy_with_logits(logits, y)
    return F.cross_entropy(logits, y)


@torch.no_grad()
def evaluate(net, tasks, val_sets, device, rank, world):
    net.eval()
    res = {}
    for t in tasks:
        ds = val_sets[t]
        stat = torch.zeros(2, device=device)
        for wav, y in DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=32, num_workers=4):
            wav, y = wav.to(device), y.to(device)
            logits = net(wav, t)
            if TASK_REGISTRY[t]["multilabel"]:
                # top-1 precision as a cheap proxy for mAP during training
                top = logits.argmax(1)
                stat[0] += y.gather(1, top[:, None]).sum()
            else:
                stat[0] += (logits.argmax(1) == y).sum()
            stat[1] += wav.size(0)
        dist.all_reduce(stat)
        res[t] = (stat[0] / stat[1]).item()
    net.train()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="audioset,voxceleb,speechcommands,crema")
    ap.add_argument("--manifest_dir", required=True)
    ap.add_argument("--out", default="runs/audio_mtl")
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--steps", type=int, default=200000)
    ap.add_argument("--eval_every", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    requested = args.tasks.split(",")
    active = set(requested) & set(TASK_REGISTRY)
    order = [t for t in requested if t in active]  # fixed visiting order for the round robin

    train_sets, val_sets, samplers, loaders = {}, {}, {}, {}
    for t in order:
        spec = TASK_REGISTRY[t]
        mk = lambda split, train: ManifestAudio(os.path.join(args.manifest_dir, f"{t}_{split}.jsonl"),
                                                spec["n_out"], spec["multilabel"], spec["clip_s"], train)
        train_sets[t], val_sets[t] = mk("train", True), mk("val", False)
        samplers[t] = DistributedSampler(train_sets[t], shuffle=True)
        loaders[t] = DataLoader(train_sets[t], batch_size=args.bs, sampler=samplers[t], num_workers=6,
                                pin_memory=True, drop_last=True, persistent_workers=True)

    net = AudioMTL({t: TASK_REGISTRY[t]["n_out"] for t in active}).to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.04)

    epochs = {t: 0 for t in order}
    its = {}
    for t in order:
        samplers[t].set_epoch(0)
        its[t] = iter(loaders[t])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    for step in range(args.steps):
        task = order[step % len(order)]
        try:
            wav, y = next(its[task])
        except StopIteration:
            epochs[task] += 1
            samplers[task].set_epoch(epochs[task])
            its[task] = iter(loaders[task])
            wav, y = next(its[task])
        wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(wav, task)
        loss = task_loss(task, logits.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        sched.step()

        if rank == 0 and step % 200 == 0:
            print(f"step {step} {task:>15s} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
        if (step + 1) % args.eval_every == 0:
            res = evaluate(model.module, order, val_sets, device, rank, world)
            if rank == 0:
                print(f"eval {step + 1}: {res}", flush=True)
                torch.save({"model": model.module.state_dict(), "tasks": order, "step": step + 1},
                           os.path.join(args.out, f"step{step + 1}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
