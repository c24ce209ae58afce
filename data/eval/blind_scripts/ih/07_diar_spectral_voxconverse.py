# -*- coding: utf-8 -*-
"""
Fine-tune a ResNet speaker embedding for diarization on VoxConverse dev / AMI train
speakers, and track DER on VoxConverse test with spectral clustering after each epoch.

  torchrun --nnodes=1 --nproc_per_node=4 07_diar_spectral_voxconverse.py \
      --init exp/r34_vox2/avg_model.pt --out exp/r34_diar_ft
"""
import argparse
import logging
import os
import random
from collections import defaultdict

import numpy as np
import scipy.linalg
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchaudio.compliance.kaldi as kaldi
from pyannote.core import Annotation, Segment
from pyannote.database.util import load_rttm
from pyannote.metrics.diarization import DiarizationErrorRate
from sklearn.cluster import KMeans
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from wespeaker.models.resnet import ResNet34
from wespeaker.models.projections import ArcMarginProduct

logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(message)s")
logger = logging.getLogger("diar_ft")


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--train-segments", default="data/diar_ft/segments.tsv")  # wav \t start \t end \t spk
    p.add_argument("--eval-wav-dir", default="data/voxconverse/test/wav")
    p.add_argument("--eval-rttm-dir", default="data/voxconverse/test/rttm")
    p.add_argument("--init", default=None)
    p.add_argument("--out", default="exp/r34_diar_ft")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seg-frames", type=int, default=150)
    p.add_argument("--win", type=float, default=1.5)
    p.add_argument("--shift", type=float, default=0.75)
    p.add_argument("--max-speakers", type=int, default=20)
    return p


def wav_to_fbank(wav, dither=0.0):
    feats = kaldi.fbank(torch.as_tensor(wav).unsqueeze(0) * 32768, num_mel_bins=80, frame_length=25,
                        frame_shift=10, dither=dither, sample_frequency=16000)
    return feats - feats.mean(dim=0)


class SegmentSet(Dataset):
    def __init__(self, tsv, seg_frames):
        rows = [l.rstrip("\n").split("\t") for l in open(tsv)]
        self.spk2id = {s: i for i, s in enumerate(sorted({r[3] for r in rows}))}
        self.rows = [(r[0], float(r[1]), float(r[2]), self.spk2id[r[3]]) for r in rows]
        self.n = (seg_frames - 1) * 160 + 400

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, st, en, y = self.rows[i]
        a, b = int(st * 16000), int(en * 16000)
        off = random.randint(a, max(a, b - self.n))
        wav, _ = sf.read(path, start=off, frames=self.n, dtype="float32")
        if len(wav) < self.n:
            wav = np.resize(wav, self.n)
        return wav_to_fbank(wav, dither=1.0), y


class EmbeddingClassifier(torch.nn.Module):
    def __init__(self, n_spk):
        super().__init__()
        self.backbone = ResNet34(feat_dim=80, embed_dim=256, pooling_func="TSTP")
        self.projection = ArcMarginProduct(256, n_spk, scale=32.0, margin=0.2)

    def embed(self, feats):
        out = self.backbone(feats)
        return out[-1] if isinstance(out, tuple) else out  # wespeaker returns (embed_a, embed_b)

    def forward(self, feats, y):
        return self.projection(self.embed(feats), y)


# ---------------------------------------------------------------- clustering
def spectral_cluster(emb, max_spk, p_prune=0.1):
    emb = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    sim = emb @ emb.T
    n = sim.shape[0]
    k = max(1, int(round(n * p_prune)))
    for i in range(n):  # keep the k strongest affinities of every row
        sim[i, np.argsort(sim[i])[:-k]] = 0.0
    sim = 0.5 * (sim + sim.T)
    deg = np.diag(sim.sum(1))
    lap = deg - sim
    vals, vecs = scipy.linalg.eigh(lap)
    gaps = np.diff(vals[: max_spk + 1])
    n_spk = int(np.argmax(gaps)) + 1
    labels = KMeans(n_clusters=n_spk, n_init=10, random_state=0).fit_predict(vecs[:, :n_spk])
    return labels


@torch.no_grad()
def diarize(net, wav_path, ref, win, shift, max_spk, device):
    audio, _ = sf.read(wav_path, dtype="float32")
    speech = ref.get_timeline().support()
    segs, feats = [], []
    for region in speech:
        t = region.start
        while t < region.end:
            seg = Segment(t, min(t + win, region.end))
            chunk = audio[int(seg.start * 16000):int(seg.end * 16000)]
            if len(chunk) >= 400:
                segs.append(seg)
                feats.append(wav_to_fbank(chunk))
            t += shift
    embs = []
    for i in range(0, len(feats), 128):
        batch = torch.nn.utils.rnn.pad_sequence(feats[i:i + 128], batch_first=True).to(device)
        embs.append(net.embed(batch).cpu())
    emb = torch.cat(embs).numpy()
    labels = spectral_cluster(emb, max_spk) if len(segs) > 2 else np.zeros(len(segs), dtype=int)
    hyp = Annotation()
    for seg, lab in zip(segs, labels):
        hyp[seg] = int(lab)
    return hyp.support()


def evaluate(net, args, device, rank, world):
    net.eval()
    refs = {}
    for f in sorted(os.listdir(args.eval_rttm_dir)):
        refs.update(load_rttm(os.path.join(args.eval_rttm_dir, f)))
    metric = DiarizationErrorRate(collar=0.25, skip_overlap=False)
    comp = defaultdict(float)
    for uri in sorted(refs)[rank::world]:
        hyp = diarize(net, os.path.join(args.eval_wav_dir, uri + ".wav"), refs[uri], args.win,
                      args.shift, args.max_speakers, device)
        d = metric(refs[uri], hyp, detailed=True)
        for key in ("missed detection", "false alarm", "confusion", "total"):
            comp[key] += d[key]
    stats = torch.tensor([comp["missed detection"], comp["false alarm"], comp["confusion"], comp["total"]],
                         dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    miss, fa, conf, total = stats.tolist()
    return {"DER": 100 * (miss + fa + conf) / total, "miss": 100 * miss / total,
            "fa": 100 * fa / total, "conf": 100 * conf / total}


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank > 0:
        logger.setLevel(logging.WARNING)

    dataset = SegmentSet(args.train_segments, args.seg_frames)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)

    model = EmbeddingClassifier(len(dataset.spk2id))
    if args.init:
        pretrained = torch.load(args.init, map_location="cpu")
        missing, unexpected = model.backbone.load_state_dict(pretrained, strict=False)
        logger.info("init from %s (missing %d, unexpected %d)", args.init, len(missing), len(unexpected))
    model = DDP(model.to(device), device_ids=[local_rank])
    # lr given for the reference 4-GPU setup
    lr = args.lr * world / 4
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader), eta_min=lr * 0.01)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        acc_loss = torch.zeros(2, device=device)
        for it, (feats, y) in enumerate(loader):
            feats, y = feats.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(feats, y)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            acc_loss[0] += loss.detach()
            acc_loss[1] += 1
        dist.all_reduce(acc_loss)
        logger.info("epoch %d train loss %.4f", epoch, (acc_loss[0] / acc_loss[1]).item())

        res = evaluate(model.module, args, device, rank, world)
        logger.info("epoch %d VoxConverse test DER %.2f (miss %.2f fa %.2f conf %.2f)", epoch,
                    res["DER"], res["miss"], res["fa"], res["conf"])
        if rank == 0:
            torch.save(model.module.backbone.state_dict(), os.path.join(args.out, f"backbone_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
