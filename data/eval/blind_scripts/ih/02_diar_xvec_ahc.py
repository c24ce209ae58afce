"""Speaker-embedding training for diarization + AMI dev DER evaluation.

Embedding extractor: SpeechBrain ECAPA-TDNN (C=512) trained on 1.5 s crops of
VoxCeleb2 + AMI-train speakers with AAM-softmax. After every epoch the model
diarizes AMI dev (oracle SAD, 1.5 s / 0.75 s uniform segmentation, PCA +
average-linkage AHC) and reports DER.

    torchrun --nproc_per_node 4 02_diar_xvec_ahc.py --exp exp/diar_ecapa512
"""
import argparse
import glob
import logging
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pyannote.core import Annotation, Segment, Timeline
from pyannote.database.util import load_rttm, load_uem
from pyannote.metrics.diarization import DiarizationErrorRate
from scipy.cluster.hierarchy import fcluster, linkage
from speechbrain.lobes.features import Fbank
from speechbrain.lobes.models.ECAPA_TDNN import ECAPA_TDNN
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("diar")
SR = 16000


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-list", default="data/diar_train/utt2spk_path.txt")
    p.add_argument("--ami-dev", default="data/ami/dev")
    p.add_argument("--exp", default="exp/diar_ecapa512")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--base-lr", type=float, default=1e-3, help="for a total batch of 256")
    p.add_argument("--crop", type=float, default=1.5)
    p.add_argument("--emb-dim", type=int, default=192)
    p.add_argument("--pca-dim", type=int, default=32)
    p.add_argument("--ahc-threshold", type=float, default=0.4)
    p.add_argument("--win", type=float, default=1.5)
    p.add_argument("--hop", type=float, default=0.75)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class AAM(nn.Module):
    def __init__(self, dim, n_cls, margin=0.2, scale=32.0):
        super().__init__()
        self.W = nn.Parameter(torch.randn(n_cls, dim) * 0.01)
        self.m, self.s = margin, scale

    def forward(self, emb, y):
        cos = F.linear(F.normalize(emb), F.normalize(self.W)).clamp(-1 + 1e-7, 1 - 1e-7)
        theta = torch.acos(cos)
        target = torch.cos(theta + self.m)
        onehot = F.one_hot(y, cos.size(1)).bool()
        logits = self.s * torch.where(onehot, target, cos)
        return F.cross_entropy(logits, y)


class Embedder(nn.Module):
    def __init__(self, emb_dim):
        super().__init__()
        self.fbank = Fbank(n_mels=80)
        self.ecapa = ECAPA_TDNN(80, channels=[512, 512, 512, 512, 1536], lin_neurons=emb_dim)

    def forward(self, wav):
        feats = self.fbank(wav)
        feats = feats - feats.mean(dim=1, keepdim=True)
        return self.ecapa(feats).squeeze(1)


class Trainer(nn.Module):
    def __init__(self, emb_dim, n_spk):
        super().__init__()
        self.embedder = Embedder(emb_dim)
        self.loss = AAM(emb_dim, n_spk)

    def forward(self, wav, y):
        return self.loss(self.embedder(wav), y)


class CropSet(Dataset):
    def __init__(self, list_path, crop_sec):
        rows = [l.split() for l in open(list_path)]
        speakers = sorted({spk for _, spk, _ in rows})
        self.spk2id = {s: i for i, s in enumerate(speakers)}
        self.rows = [(path, self.spk2id[spk]) for _, spk, path in rows]
        self.crop = int(crop_sec * SR)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, y = self.rows[i]
        info = sf.info(path)
        if info.frames > self.crop:
            off = random.randint(0, info.frames - self.crop)
            wav, _ = sf.read(path, start=off, frames=self.crop, dtype="float32")
        else:
            wav, _ = sf.read(path, dtype="float32")
            wav = np.pad(wav, (0, self.crop - len(wav)), mode="wrap")
        return torch.from_numpy(wav), y


# --------------------------------------------------------------------------- diarization
def uniform_subsegments(speech: Timeline, win, hop):
    segs = []
    for region in speech:
        start = region.start
        while start + win < region.end:
            segs.append(Segment(start, start + win))
            start += hop
        segs.append(Segment(max(region.start, region.end - win), region.end))
    return segs


@torch.no_grad()
def embed_meeting(embedder, wav_path, segs, device, bs=64):
    audio, sr = sf.read(wav_path, dtype="float32")
    assert sr == SR
    n = int(1.5 * SR)
    chunks = []
    for s in segs:
        x = audio[int(s.start * SR):int(s.end * SR)]
        if len(x) < n:
            x = np.pad(x, (0, n - len(x)), mode="wrap")
        chunks.append(torch.from_numpy(x[:n]))
    embs = []
    for i in range(0, len(chunks), bs):
        x = torch.stack(chunks[i:i + bs]).to(device)
        embs.append(embedder(x))
    return torch.cat(embs)


def ahc_labels(emb, threshold):
    emb = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    Z = linkage(emb, method="average", metric="cosine")
    return fcluster(Z, t=threshold, criterion="distance")


def to_annotation(uri, segs, labels, hop):
    ann = Annotation(uri=uri)
    # each subsegment owns the part of it closest to its centre
    for i, (seg, lab) in enumerate(zip(segs, labels)):
        start = seg.start if i == 0 or segs[i - 1].end <= seg.start else (seg.start + segs[i - 1].end) / 2
        end = seg.end if i + 1 == len(segs) or segs[i + 1].start >= seg.end else (seg.end + segs[i + 1].start) / 2
        ann[Segment(start, end)] = f"spk{lab}"
    return ann.support(collar=0.0)


def evaluate_der(embedder, args, device, rank, world):
    embedder.eval()
    refs = {}
    for f in glob.glob(os.path.join(args.ami_dev, "rttm", "*.rttm")):
        refs.update(load_rttm(f))
    uems = load_uem(os.path.join(args.ami_dev, "dev.uem"))
    uris = sorted(refs)[rank::world]

    meetings = []
    for uri in uris:
        speech = refs[uri].get_timeline().support()
        segs = uniform_subsegments(speech, args.win, args.hop)
        emb = embed_meeting(embedder, os.path.join(args.ami_dev, "wav", uri + ".wav"), segs, device)
        meetings.append((uri, segs, emb))

    # PCA fitted on all dev segments of all ranks
    local = torch.cat([e for _, _, e in meetings])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    allemb = torch.cat(gathered).float()
    mean = allemb.mean(0, keepdim=True)
    _, _, V = torch.pca_lowrank(allemb - mean, q=args.pca_dim, center=False)

    metric = DiarizationErrorRate(collar=0.25, skip_overlap=True)
    tot = np.zeros(4)
    for uri, segs, emb in meetings:
        z = ((emb.float() - mean) @ V).cpu().numpy()
        labels = ahc_labels(z, args.ahc_threshold)
        hyp = to_annotation(uri, segs, labels, args.hop)
        d = metric(refs[uri], hyp, uem=uems.get(uri), detailed=True)
        tot += [d["missed detection"], d["false alarm"], d["confusion"], d["total"]]
    tot = torch.tensor(tot, device=device, dtype=torch.float64)
    dist.all_reduce(tot)
    miss, fa, conf, total = tot.tolist()
    return 100 * (miss + fa + conf) / total, 100 * conf / total


def main():
    args = get_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    if rank != 0:
        log.setLevel(logging.WARNING)

    data = CropSet(args.train_list, args.crop)
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    net = Trainer(args.emb_dim, len(data.spk2id)).to(device)
    net = DistributedDataParallel(net, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world / 256
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(loader),
                                                pct_start=0.05)
    os.makedirs(args.exp, exist_ok=True)
    log.info("speakers=%d utts=%d world=%d lr=%.2e", len(data.spk2id), len(data), world, lr)

    best = math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        running = torch.zeros(2, device=device)
        for step, (wav, y) in enumerate(loader):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = net(wav, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 5.0)
            opt.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % 200 == 199:
                dist.all_reduce(running)
                log.info("epoch %d step %d loss %.4f", epoch, step + 1, (running[0] / running[1]).item())
                running.zero_()

        der, conf = evaluate_der(net.module.embedder, args, device, rank, world)
        log.info("epoch %d AMI-dev DER %.2f%% (confusion %.2f%%)", epoch, der, conf)
        if rank == 0:
            state = {"embedder": net.module.embedder.state_dict(), "epoch": epoch, "der": der}
            torch.save(state, os.path.join(args.exp, f"epoch{epoch:03d}.pt"))
            if der < best:
                best = der
                torch.save(state, os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
