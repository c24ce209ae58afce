"""Fine-tune an x-vector extractor on AMI-train speakers and tune AHC on AMI dev.

Single node, one process per visible GPU started with torch.multiprocessing:

    python 15_diar_ami_spawn_pca_ahc.py --init exp/ecapa_vox/encoder.pt --out exp/ami_ft

Each rank diarizes its share of the dev meetings; the PCA used before AHC is
fitted on the segment embeddings of all meetings, gathered from all ranks.
"""
import argparse
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from pyannote.core import Annotation, Segment
from pyannote.database.util import load_rttm, load_uem
from pyannote.metrics.diarization import DiarizationErrorRate
from scipy.cluster.hierarchy import fcluster, linkage
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from sv.model import ECAPATDNN, AAMSoftmax

SR = 16000


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--init", required=True)
    p.add_argument("--train-segments", default="data/ami/train/segments_spk.tsv")
    p.add_argument("--dev-dir", default="data/ami/dev")
    p.add_argument("--out", default="exp/ami_ft")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--crop", type=float, default=1.5)
    p.add_argument("--pca-dim", type=int, default=24)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.4, 0.5, 0.6, 0.7])
    p.add_argument("--port", default="29533")
    return p.parse_args()


class AmiSegments(Dataset):
    """Single-speaker regions of AMI train: wav<TAB>start<TAB>end<TAB>speaker."""

    def __init__(self, tsv, crop):
        rows = [l.rstrip("\n").split("\t") for l in open(tsv)]
        self.spk2id = {s: i for i, s in enumerate(sorted({r[3] for r in rows}))}
        self.rows = [(r[0], float(r[1]), float(r[2]), self.spk2id[r[3]]) for r in rows
                     if float(r[2]) - float(r[1]) >= 0.5]
        self.n = int(crop * SR)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        wav_path, st, en, y = self.rows[i]
        a = int(st * SR)
        off = random.randint(a, max(a, int(en * SR) - self.n))
        wav, _ = sf.read(wav_path, start=off, frames=min(self.n, int(en * SR) - off), dtype="float32")
        if len(wav) < self.n:
            wav = np.pad(wav, (0, self.n - len(wav)), mode="wrap")
        return torch.from_numpy(wav), y


class FineTuner(torch.nn.Module):
    def __init__(self, n_spk):
        super().__init__()
        self.encoder = ECAPATDNN(C=1024, emb_dim=192)
        self.head = AAMSoftmax(192, n_spk, m=0.2, s=30.0)

    def forward(self, wav, y):
        return self.head(self.encoder(wav), y)


def gather_variable(t, world):
    """all_gather for tensors whose first dimension differs between ranks."""
    n = torch.tensor([t.size(0)], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    padded = torch.zeros((max(sizes),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.size(0)] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def segment_embeddings(encoder, wav_path, speech, device, win=1.5, hop=0.75):
    audio, _ = sf.read(wav_path, dtype="float32")
    segs = []
    for region in speech:
        t = region.start
        while t + win <= region.end:
            segs.append(Segment(t, t + win))
            t += hop
        if region.duration >= 0.5 and (not segs or segs[-1].end < region.end):
            segs.append(Segment(max(region.start, region.end - win), region.end))
    n = int(win * SR)
    x = []
    for s in segs:
        c = audio[int(s.start * SR):int(s.start * SR) + n]
        x.append(torch.from_numpy(np.pad(c, (0, n - len(c)), mode="wrap") if len(c) < n else c))
    embs = [encoder(torch.stack(x[i:i + 256]).to(device)) for i in range(0, len(x), 256)]
    return segs, torch.cat(embs) if embs else torch.zeros(0, 192, device=device)


def segments_to_annotation(uri, segs, labels):
    ann = Annotation(uri=uri)
    for i, (s, lab) in enumerate(zip(segs, labels)):
        st = s.start if i == 0 or segs[i - 1].end <= s.start else 0.5 * (s.start + segs[i - 1].end)
        en = s.end if i + 1 == len(segs) or segs[i + 1].start >= s.end else 0.5 * (s.end + segs[i + 1].start)
        ann[Segment(st, en)] = int(lab)
    return ann.support()


def evaluate(encoder, args, device, rank, world):
    encoder.eval()
    refs = {}
    for f in sorted(os.listdir(os.path.join(args.dev_dir, "rttm"))):
        refs.update(load_rttm(os.path.join(args.dev_dir, "rttm", f)))
    uems = load_uem(os.path.join(args.dev_dir, "dev.uem"))
    mine = []
    for uri in sorted(refs)[rank::world]:
        segs, e = segment_embeddings(encoder, os.path.join(args.dev_dir, "wav", f"{uri}.wav"),
                                     refs[uri].get_timeline().support(), device)
        mine.append((uri, segs, e))
    local = torch.cat([e for _, _, e in mine]) if mine else torch.zeros(0, 192, device=device)
    allemb = gather_variable(local.float(), world)
    mean = allemb.mean(0, keepdim=True)
    _, _, V = torch.pca_lowrank(allemb - mean, q=args.pca_dim, center=False)

    metric = DiarizationErrorRate(collar=0.25, skip_overlap=True)
    stats = torch.zeros(len(args.thresholds), 4, dtype=torch.float64, device=device)
    for uri, segs, e in mine:
        z = F.normalize((e.float() - mean) @ V, dim=1).cpu().numpy()
        Z = linkage(z, method="average", metric="cosine") if len(segs) > 1 else None
        for j, thr in enumerate(args.thresholds):
            labels = fcluster(Z, t=thr, criterion="distance") if Z is not None else np.ones(len(segs), int)
            d = metric(refs[uri], segments_to_annotation(uri, segs, labels), uem=uems[uri], detailed=True)
            stats[j] += torch.tensor([d["missed detection"], d["false alarm"], d["confusion"], d["total"]],
                                     dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    der = 100 * stats[:, :3].sum(1) / stats[:, 3]
    return {thr: float(d) for thr, d in zip(args.thresholds, der)}


def worker(rank, world, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    random.seed(1234 + rank)

    data = AmiSegments(args.train_segments, args.crop)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True)

    model = FineTuner(len(data.spk2id))
    model.encoder.load_state_dict(torch.load(args.init, map_location="cpu"))
    model = DDP(model.to(device), device_ids=[rank])
    opt = torch.optim.Adam([{"params": model.module.encoder.parameters(), "lr": args.lr * world},
                            {"params": model.module.head.parameters(), "lr": 10 * args.lr * world}])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = (float("inf"), None)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for wav, y in loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss, _ = model(wav, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        ders = evaluate(model.module.encoder, args, device, rank, world)
        if rank == 0:
            thr, der = min(ders.items(), key=lambda kv: kv[1])
            print(f"epoch {epoch} loss {run[0] / run[1]:.4f} | " +
                  " ".join(f"thr{t:.2f}:{d:.2f}" for t, d in ders.items()), flush=True)
            if der < best[0]:
                best = (der, thr)
                torch.save({"encoder": model.module.encoder.state_dict(), "ahc_threshold": thr, "der": der,
                            "epoch": epoch}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    n_gpus = torch.cuda.device_count()
    mp.spawn(worker, args=(n_gpus, args), nprocs=n_gpus, join=True)
