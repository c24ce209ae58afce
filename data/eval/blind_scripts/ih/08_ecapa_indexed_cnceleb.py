"""CN-Celeb1+2 speaker verification with ECAPA-TDNN and sub-center AAM.

The training index (utterance path, speaker, number of samples) is built once
from the raw flac tree and cached next to the experiment, because scanning the
~700k CN-Celeb files with soundfile.info takes a while.

    torchrun --nproc_per_node=8 08_ecapa_indexed_cnceleb.py conf/cnceleb_ecapa.yaml
"""
import glob
import os
import pickle
import random
import sys
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from nnet.ecapa import EcapaTdnn
from nnet.frontend import LogMelFbank
from scoring import cosine_scoring, eer_and_mindcf


class SubCenterAAM(nn.Module):
    def __init__(self, emb_dim, n_spk, k=3, margin=0.2, scale=32.0):
        super().__init__()
        self.k, self.n_spk = k, n_spk
        self.weight = nn.Parameter(torch.empty(n_spk * k, emb_dim))
        nn.init.xavier_uniform_(self.weight)
        self.margin, self.scale = margin, scale

    def forward(self, emb, label):
        cos = F.linear(F.normalize(emb), F.normalize(self.weight))
        cos = cos.view(-1, self.n_spk, self.k).max(dim=2).values
        cos = cos.clamp(-1.0 + 1e-7, 1.0 - 1e-7)
        target = torch.cos(torch.acos(cos) + self.margin)
        mask = F.one_hot(label, self.n_spk).bool()
        logits = self.scale * torch.where(mask, target, cos)
        return F.cross_entropy(logits, label)


class Net(nn.Module):
    def __init__(self, cfg, n_spk):
        super().__init__()
        self.frontend = LogMelFbank(n_mels=cfg.n_mels)
        self.encoder = EcapaTdnn(cfg.n_mels, channels=cfg.channels, emb_dim=cfg.emb_dim)
        self.head = SubCenterAAM(cfg.emb_dim, n_spk, k=cfg.subcenters, margin=cfg.margin, scale=cfg.scale)

    def embedding(self, wav):
        return self.encoder(self.frontend(wav))

    def forward(self, wav, label):
        return self.head(self.embedding(wav), label)


def build_index(roots, min_sec):
    entries = []
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "data", "*", "*.flac"))):
            spk = path.split(os.sep)[-2]
            n = sf.info(path).frames
            if n >= min_sec * 16000:
                entries.append((path, spk, n))
    return entries


def load_or_build_index(cfg):
    cache = os.path.join(cfg.exp_dir, "cache", "train_index.pkl")
    if os.path.exists(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)
    entries = build_index(cfg.train_roots, cfg.min_sec)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    with open(cache, "wb") as f:
        pickle.dump(entries, f)
    return entries


class CNCelebCrops(Dataset):
    def __init__(self, entries, crop_sec):
        self.spk2id = {s: i for i, s in enumerate(sorted({spk for _, spk, _ in entries}))}
        self.entries = entries
        self.crop = int(crop_sec * 16000)

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, idx):
        path, spk, n = self.entries[idx]
        start = random.randint(0, max(0, n - self.crop))
        wav, _ = sf.read(path, start=start, frames=self.crop, dtype="float32")
        if len(wav) < self.crop:
            wav = np.pad(wav, (0, self.crop - len(wav)), mode="wrap")
        return torch.from_numpy(wav), self.spk2id[spk]


@torch.no_grad()
def eval_trials(model, cfg, device, rank, world):
    model.eval()
    with open(cfg.trials) as f:
        trials = [l.split() for l in f]
    enroll = sorted({t[0] for t in trials})
    tests = sorted({t[1] for t in trials})
    jobs = [("enroll", u) for u in enroll] + [("test", u) for u in tests]
    mine = {}
    for kind, utt in jobs[rank::world]:
        if kind == "enroll":  # CN-Celeb enrollment: concatenate all enrollment flacs of the speaker
            wav = np.concatenate([sf.read(p, dtype="float32")[0]
                                  for p in sorted(glob.glob(os.path.join(cfg.enroll_dir, utt + "*.flac")))])
        else:
            wav, _ = sf.read(os.path.join(cfg.test_dir, utt), dtype="float32")
        x = torch.from_numpy(wav[: 16000 * cfg.max_eval_sec]).unsqueeze(0).to(device)
        mine[(kind, utt)] = model.embedding(x).squeeze(0).cpu().numpy()
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    if rank != 0:
        return None
    embs = {}
    for p in parts:
        embs.update(p)
    scores = cosine_scoring([embs[("enroll", e)] for e, _, _ in trials],
                            [embs[("test", t)] for _, t, _ in trials])
    labels = np.array([int(lab) for _, _, lab in trials])
    return eer_and_mindcf(scores, labels, p_target=0.01)


def main():
    cfg = OmegaConf.merge(OmegaConf.load(sys.argv[1]), OmegaConf.from_cli(sys.argv[2:]))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    entries = load_or_build_index(cfg)
    data = CNCelebCrops(entries, cfg.crop_sec)
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=cfg.batch_size_per_gpu, sampler=sampler,
                        num_workers=cfg.num_workers, pin_memory=True, drop_last=True)

    model = Net(cfg, len(data.spk2id)).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    base_lr = cfg.lr * world * cfg.batch_size_per_gpu / 256
    opt = torch.optim.AdamW(ddp.parameters(), lr=base_lr, weight_decay=cfg.weight_decay)
    iters = len(loader) * cfg.epochs
    warm = len(loader) * cfg.warmup_epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / (iters - warm))))

    if rank == 0:
        print(f"{len(entries)} utterances, {len(data.spk2id)} speakers, lr {base_lr:.2e}", flush=True)
        OmegaConf.save(cfg, os.path.join(cfg.exp_dir, "config.yaml"))

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        tic = time.time()
        loss_acc = torch.zeros(2, device=device)
        for it, (wav, label) in enumerate(loader):
            wav = wav.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            loss = ddp(wav, label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
            opt.step()
            sched.step()
            loss_acc += torch.stack([loss.detach(), torch.ones_like(loss)])
            if (it + 1) % cfg.log_interval == 0:
                dist.all_reduce(loss_acc)
                if rank == 0:
                    print(f"epoch {epoch} iter {it + 1}/{len(loader)} loss {loss_acc[0] / loss_acc[1]:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {time.time() - tic:.0f}s", flush=True)
                loss_acc.zero_()

        if (epoch + 1) % cfg.eval_interval == 0:
            res = eval_trials(model, cfg, device, rank, world)
            if rank == 0:
                print(f"epoch {epoch} CNC-eval EER {res[0]:.3f}% minDCF {res[1]:.4f}", flush=True)
        if rank == 0:
            torch.save({"model": model.state_dict(), "epoch": epoch, "spk2id": data.spk2id},
                       os.path.join(cfg.exp_dir, f"model_{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
