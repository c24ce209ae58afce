"""Domain adaptation of a VoxCeleb ECAPA model to 8 kHz call-centre speech.

The pretrained encoder is kept (lower blocks frozen); a small adapter
(Linear-BN-ReLU-Linear) and a fresh AAM head are trained on the in-domain
enrolment corpus (a few thousand calls). Evaluation uses the in-domain trial
list; the adapter + encoder are exported as a TorchScript module at the end.

    torchrun --nproc_per_node=4 16_callcenter_adapter_ft.py --config conf/cc_adapt.yaml
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from sklearn.metrics import roc_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from sv.model import ECAPATDNN, AAMSoftmax


class CallSegments(Dataset):
    """jsonl rows: {"audio": path, "speaker": id, "channel": "agent"|"customer"}; audio is 8 kHz."""

    def __init__(self, jsonl, seconds, spk2id=None):
        self.rows = [json.loads(l) for l in open(jsonl)]
        self.spk2id = spk2id or {s: i for i, s in enumerate(sorted({r["speaker"] for r in self.rows}))}
        self.n = int(seconds * 16000)
        self.resample = torchaudio.transforms.Resample(8000, 16000)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = torchaudio.load(r["audio"])
        wav = self.resample(wav[0]) if sr == 8000 else wav[0]
        if wav.numel() < self.n:
            wav = wav.repeat(self.n // wav.numel() + 1)
        s = random.randint(0, wav.numel() - self.n)
        return wav[s:s + self.n], self.spk2id[r["speaker"]]


class AdaptedEncoder(nn.Module):
    def __init__(self, encoder, dim=192, hidden=256):
        super().__init__()
        self.encoder = encoder
        self.adapter = nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                     nn.Linear(hidden, dim))

    def forward(self, wav):
        e = self.encoder(wav)
        return e + self.adapter(e)


class Model(nn.Module):
    def __init__(self, encoder, n_spk):
        super().__init__()
        self.backbone = AdaptedEncoder(encoder)
        self.head = AAMSoftmax(192, n_spk, m=0.2, s=30.0)

    def forward(self, wav, y):
        return self.head(self.backbone(wav), y)


def freeze_lower_blocks(encoder, n_trainable):
    blocks = [encoder.conv1, encoder.bn1, encoder.layer1, encoder.layer2, encoder.layer3]
    for b in blocks[: len(blocks) - n_trainable]:
        for p in b.parameters():
            p.requires_grad_(False)


@torch.no_grad()
def score_trials(backbone, cfg, device, rank, world):
    backbone.eval()
    rows = [json.loads(l) for l in open(cfg["eval_jsonl"])]
    audio = {r["id"]: r["audio"] for r in rows}
    ids = sorted(audio)
    mine = {}
    for k in ids[rank::world]:
        wav, sr = torchaudio.load(audio[k])
        wav = torchaudio.functional.resample(wav, sr, 16000)
        mine[k] = F.normalize(backbone(wav.to(device)), dim=-1)[0].cpu()
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    emb = {k: v for p in parts for k, v in p.items()}
    trials = [l.split() for l in open(cfg["trials"])]
    scores = np.array([float(emb[a] @ emb[b]) for a, b, _ in trials])
    labels = np.array([int(t[2]) for t in trials])
    fpr, tpr, _ = roc_curve(labels, scores)
    i = np.nanargmin(np.abs(1 - tpr - fpr))
    return 50 * (fpr[i] + 1 - tpr[i])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train = CallSegments(cfg["train_jsonl"], cfg["seconds"])
    per_gpu = cfg["global_batch"] // world
    sampler = DistributedSampler(train, shuffle=True, seed=cfg.get("seed", 0))
    loader = DataLoader(train, batch_size=per_gpu, sampler=sampler, num_workers=4, pin_memory=True)

    encoder = ECAPATDNN(C=1024, emb_dim=192)
    encoder.load_state_dict(torch.load(cfg["pretrained"], map_location="cpu"))
    freeze_lower_blocks(encoder, cfg.get("trainable_blocks", 2))
    model = Model(encoder, len(train.spk2id)).to(device)
    model = DDP(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"] * len(loader))
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"{len(train)} training calls, {len(train.spk2id)} speakers, per-GPU batch {per_gpu}", flush=True)

    eer0 = score_trials(model.module.backbone, cfg, device, rank, world)
    if rank == 0:
        print(f"before adaptation: in-domain EER {eer0:.2f}%", flush=True)
    best = eer0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for wav, y in loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss, acc = model(wav, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        eer = score_trials(model.module.backbone, cfg, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch}: loss {tot[0] / tot[1]:.4f} in-domain EER {eer:.2f}%", flush=True)
            if eer < best:
                best = eer
                torch.save(model.module.backbone.state_dict(), os.path.join(cfg["out_dir"], "best_backbone.pt"))
        dist.barrier()

    if rank == 0 and os.path.exists(os.path.join(cfg["out_dir"], "best_backbone.pt")):
        backbone = AdaptedEncoder(ECAPATDNN(C=1024, emb_dim=192))
        backbone.load_state_dict(torch.load(os.path.join(cfg["out_dir"], "best_backbone.pt"), map_location="cpu"))
        torch.jit.script(backbone.eval()).save(os.path.join(cfg["out_dir"], "cc_ecapa_adapted.ts"))
        print(f"exported best model (EER {best:.2f}%)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
