"""WavLM-Base+ front-end + ECAPA back-end for speaker verification.

The weighted sum of all WavLM hidden layers is fed to a small ECAPA-TDNN;
the whole stack (except the CNN feature encoder) is fine-tuned with
AAM-softmax on VoxCeleb2. Gradient checkpointing is enabled on the
transformer so that 3 s crops x 64 per GPU (8 GPUs) fit in 40 GB.

    torchrun --nproc_per_node=8 06_wavlm_ecapa_finetune.py --output exp/wavlm_ecapa
"""
import argparse
import json
import math
import os
import random
from dataclasses import asdict, dataclass

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import WavLMModel, get_cosine_schedule_with_warmup

from ecapa import ECAPA_TDNN_small  # local module: ECAPA-TDNN taking (B, T, D) features


@dataclass
class Config:
    pretrained: str = "microsoft/wavlm-base-plus"
    train_jsonl: str = "data/vox2_dev.jsonl"
    trials: str = "data/vox1_O_cleaned.txt"
    vox1_dir: str = "data/voxceleb1/wav"
    output: str = "exp/wavlm_ecapa"
    crop_sec: float = 3.0
    global_batch: int = 512  # split over the GPUs
    epochs: int = 10
    lr_backend: float = 1e-3
    lr_wavlm: float = 5e-5
    warmup_steps: int = 2000
    margin: float = 0.2
    scale: float = 30.0
    emb_dim: int = 256
    workers: int = 8


class AAMSoftmax(nn.Module):
    def __init__(self, dim, n_cls, m, s):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n_cls, dim))
        nn.init.normal_(self.w, std=0.01)
        self.m, self.s = m, s

    def forward(self, x, y):
        cos = F.linear(F.normalize(x), F.normalize(self.w))
        cos_m = torch.cos(torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6)) + self.m)
        logits = self.s * torch.where(F.one_hot(y, cos.size(1)).bool(), cos_m, cos)
        return F.cross_entropy(logits, y), (cos.argmax(1) == y).float().mean()


class WavLMSpeaker(nn.Module):
    def __init__(self, cfg: Config, n_spk: int):
        super().__init__()
        self.wavlm = WavLMModel.from_pretrained(cfg.pretrained, mask_time_prob=0.0)
        self.wavlm.freeze_feature_encoder()
        self.wavlm.gradient_checkpointing_enable()
        n_layers = self.wavlm.config.num_hidden_layers + 1
        self.layer_weights = nn.Parameter(torch.zeros(n_layers))
        self.backend = ECAPA_TDNN_small(in_dim=self.wavlm.config.hidden_size, emb_dim=cfg.emb_dim)
        self.loss = AAMSoftmax(cfg.emb_dim, n_spk, cfg.margin, cfg.scale)

    def embed(self, wav):
        wav = (wav - wav.mean(-1, keepdim=True)) / (wav.std(-1, keepdim=True) + 1e-5)
        out = self.wavlm(wav, output_hidden_states=True)
        hs = torch.stack(out.hidden_states, dim=0)  # (L, B, T, D)
        w = torch.softmax(self.layer_weights, dim=0).view(-1, 1, 1, 1)
        feats = (w * hs).sum(0)
        return self.backend(feats)

    def forward(self, wav, y):
        return self.loss(self.embed(wav), y)


class JsonlCrops(Dataset):
    def __init__(self, path, crop_sec):
        with open(path) as f:
            self.items = [json.loads(l) for l in f]
        speakers = sorted({it["spk"] for it in self.items})
        self.spk2id = {s: i for i, s in enumerate(speakers)}
        self.n = int(crop_sec * 16000)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        frames = it["num_samples"]
        start = random.randint(0, max(0, frames - self.n))
        wav, _ = sf.read(it["path"], start=start, frames=self.n, dtype="float32")
        if len(wav) < self.n:
            wav = np.tile(wav, self.n // len(wav) + 1)[: self.n]
        return torch.from_numpy(wav), self.spk2id[it["spk"]]


@torch.no_grad()
def vox1_eer(model, cfg, device, rank, world):
    model.eval()
    trials = [l.split() for l in open(cfg.trials)]
    utts = sorted({x for t in trials for x in t[1:]})
    part = {}
    for u in utts[rank::world]:
        wav, _ = sf.read(os.path.join(cfg.vox1_dir, u), dtype="float32")
        wav = torch.from_numpy(wav)[None, : 16000 * 20].to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            e = model.embed(wav)
        part[u] = F.normalize(e.float(), dim=-1)[0].cpu()
    gathered = [None] * world
    dist.all_gather_object(gathered, part)
    if rank:
        return None
    emb = {}
    for g in gathered:
        emb.update(g)
    scores = np.array([float(emb[a] @ emb[b]) for _, a, b in trials])
    labels = np.array([int(t[0]) for t in trials])
    order = np.argsort(-scores)
    tp = np.cumsum(labels[order]) / labels.sum()
    fp = np.cumsum(1 - labels[order]) / (1 - labels).sum()
    i = np.argmin(np.abs((1 - tp) - fp))
    return 50.0 * ((1 - tp[i]) + fp[i])


def main():
    parser = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        parser.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    cfg = Config(**vars(parser.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data = JsonlCrops(cfg.train_jsonl, cfg.crop_sec)
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=cfg.global_batch // world, sampler=sampler, num_workers=cfg.workers,
                        pin_memory=True, drop_last=True)

    model = WavLMSpeaker(cfg, len(data.spk2id)).to(device)
    # WavLM LayerDrop skips whole transformer layers at random during training
    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    wavlm_params = [p for n, p in model.named_parameters() if n.startswith("wavlm.") and p.requires_grad]
    other_params = [p for n, p in model.named_parameters() if not n.startswith("wavlm.")]
    opt = torch.optim.AdamW([{"params": wavlm_params, "lr": cfg.lr_wavlm},
                             {"params": other_params, "lr": cfg.lr_backend}], weight_decay=1e-4)
    total = cfg.epochs * len(loader)
    sched = get_cosine_schedule_with_warmup(opt, cfg.warmup_steps, total)

    if rank == 0:
        os.makedirs(cfg.output, exist_ok=True)
        with open(os.path.join(cfg.output, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)

    best = math.inf
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        stats = torch.zeros(3, device=device)
        for step, (wav, y) in enumerate(loader):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, acc = ddp(wav, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 10.0)
            opt.step()
            sched.step()
            stats += torch.stack([loss.detach().float(), acc.detach().float(), torch.ones((), device=device)])
            if step % 50 == 0:
                snapshot = stats.clone()
                dist.all_reduce(snapshot)
                if rank == 0:
                    print(f"[{epoch}:{step}/{len(loader)}] loss {snapshot[0] / snapshot[2]:.3f} "
                          f"acc {snapshot[1] / snapshot[2]:.3f} lr {sched.get_last_lr()[1]:.2e}", flush=True)

        eer = vox1_eer(model, cfg, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch}: Vox1-O EER {eer:.3f}%", flush=True)
            torch.save({"model": model.state_dict(), "epoch": epoch, "eer": eer, "spk2id": data.spk2id},
                       os.path.join(cfg.output, f"epoch{epoch}.pt"))
            if eer < best:
                best = eer
                torch.save(model.state_dict(), os.path.join(cfg.output, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
