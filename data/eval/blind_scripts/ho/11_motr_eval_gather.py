"""Distributed inference + evaluation for a trained MOTR-style tracker.

Sequences are split across GPUs; every GPU tracks its own sequences, results are
collected on rank 0, which writes MOTChallenge txt files and computes CLEAR / ID metrics.

Usage:
    torchrun --nproc_per_node=8 11_motr_eval_gather.py --ckpt runs/motr/checkpoint.pth \
        --split-dir /data/DanceTrack/val --out results/motr_dancetrack_val
"""
import argparse
import configparser
import logging
import os
import time

import motmetrics as mm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms.functional as TF
from PIL import Image
from torchvision.ops import box_convert, nms

LOG = logging.getLogger("motr.eval")


class MLP(nn.Sequential):
    def __init__(self, d, out, n=3):
        layers = []
        for _ in range(n - 1):
            layers += [nn.Linear(d, d), nn.ReLU(inplace=True)]
        super().__init__(*layers, nn.Linear(d, out))


class QIM(nn.Module):
    def __init__(self, dim=256):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 1024), nn.ReLU(inplace=True), nn.Linear(1024, dim))

    def forward(self, q):
        q = self.norm1(q + self.attn(q, q, q)[0])
        return self.norm2(q + self.ffn(q))


class MOTR(nn.Module):
    def __init__(self, num_queries=300, dim=256):
        super().__init__()
        r50 = torchvision.models.resnet50(weights=None, norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r50.children())[:-2])
        self.input_proj = nn.Conv2d(2048, dim, 1)
        self.pos = nn.Parameter(torch.zeros(1, dim, 19, 34))
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.1, batch_first=True), 6)
        self.query_embed = nn.Embedding(num_queries, dim)
        self.class_head = nn.Linear(dim, 1)
        self.box_head = MLP(dim, 4)
        self.qim = QIM(dim)

    def step(self, img, track_q):
        feat = self.input_proj(self.backbone(img))
        memory = (feat + F.interpolate(self.pos, size=feat.shape[-2:], mode="bilinear", align_corners=False)).flatten(2).transpose(1, 2)
        q = self.query_embed.weight[None]
        if track_q is not None:
            q = torch.cat([track_q, q], 1)
        hs = self.decoder(q, memory)
        return hs[0], self.class_head(hs)[0, :, 0].sigmoid(), self.box_head(hs)[0].sigmoid()


def seq_info(seq_dir):
    ini = configparser.ConfigParser()
    ini.read(os.path.join(seq_dir, "seqinfo.ini"))
    s = ini["Sequence"]
    return int(s["seqLength"]), int(s["imWidth"]), int(s["imHeight"]), s.get("imExt", ".jpg")


@torch.no_grad()
def track_sequence(model, seq_dir, seq_idx, device, det_thr=0.7, keep_thr=0.6, miss_tolerance=20):
    n, W, H, ext = seq_info(seq_dir)
    scale = torch.tensor([W, H, W, H], device=device, dtype=torch.float32)
    track_q, track_ids, misses, next_id = None, [], [], 1
    rows = []
    for f in range(1, n + 1):
        img = Image.open(os.path.join(seq_dir, "img1", f"{f:08d}{ext}")).convert("RGB")
        x = TF.normalize(TF.to_tensor(TF.resize(img, [608, 1088])), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        hs, scores, boxes = model.step(x[None].to(device), track_q)
        boxes = box_convert(boxes, "cxcywh", "xyxy") * scale
        nt = len(track_ids)
        keep_q, keep_ids, keep_miss = [], [], []
        for k in range(nt):
            if scores[k] > keep_thr:
                keep_q.append(k)
                keep_ids.append(track_ids[k])
                keep_miss.append(0)
                rows.append([f, track_ids[k], *boxes[k].tolist(), scores[k].item(), seq_idx])
            elif misses[k] + 1 < miss_tolerance:
                keep_q.append(k)
                keep_ids.append(track_ids[k])
                keep_miss.append(misses[k] + 1)
        new = nt + torch.nonzero(scores[nt:] > det_thr).flatten()
        if len(new):
            new = new[nms(boxes[new], scores[new], 0.6)]
        for k in new.tolist():
            keep_q.append(k)
            keep_ids.append(next_id)
            keep_miss.append(0)
            rows.append([f, next_id, *boxes[k].tolist(), scores[k].item(), seq_idx])
            next_id += 1
        if keep_q:
            track_q = model.qim(hs[keep_q][None])
        else:
            track_q = None
        track_ids, misses = keep_ids, keep_miss
    return torch.tensor(rows, dtype=torch.float32, device=device).reshape(-1, 8)


def write_mot(rows, path):
    with open(path, "w") as fh:
        for f, tid, x1, y1, x2, y2, s, _ in rows.tolist():
            fh.write(f"{int(f)},{int(tid)},{x1:.2f},{y1:.2f},{x2 - x1:.2f},{y2 - y1:.2f},{s:.3f},-1,-1,-1\n")


def evaluate(split_dir, seqs, out_dir):
    mh = mm.metrics.create()
    accs = []
    for s in seqs:
        gt = mm.io.loadtxt(os.path.join(split_dir, s, "gt", "gt.txt"), fmt="mot15-2D", min_confidence=1)
        ts = mm.io.loadtxt(os.path.join(out_dir, f"{s}.txt"), fmt="mot15-2D")
        accs.append(mm.utils.compare_to_groundtruth(gt, ts, "iou", distth=0.5))
    summary = mh.compute_many(accs, names=seqs, metrics=mm.metrics.motchallenge_metrics, generate_overall=True)
    return mm.io.render_summary(summary, formatters=mh.formatters, namemap=mm.io.motchallenge_metric_names)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--split-dir", default="/data/DanceTrack/val")
    ap.add_argument("--out", default="results/motr_val")
    ap.add_argument("--det-thr", type=float, default=0.7)
    ap.add_argument("--keep-thr", type=float, default=0.6)
    ap.add_argument("--no-eval", action="store_true", help="test split: only write txt files")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")

    model = MOTR()
    state = torch.load(args.ckpt, map_location="cpu")
    state = state.get("model", state)
    model.load_state_dict({k.replace("module.", "", 1): v for k, v in state.items()})
    model.to(device).eval()

    seqs = sorted(d for d in os.listdir(args.split_dir) if os.path.isdir(os.path.join(args.split_dir, d)))
    my_seqs = list(range(rank, len(seqs), world))
    LOG.info("%d sequences on %d GPUs", len(seqs), world)

    t0 = time.time()
    parts = [torch.zeros(0, 8, device=device)]
    for i in my_seqs:
        parts.append(track_sequence(model, os.path.join(args.split_dir, seqs[i]), i, device, args.det_thr, args.keep_thr))
        LOG.info("rank %d finished %s (%.0fs)", rank, seqs[i], time.time() - t0)
    local = torch.cat(parts)

    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        results = torch.cat(gathered).cpu()
        for i, s in enumerate(seqs):
            write_mot(results[results[:, 7] == i], os.path.join(args.out, f"{s}.txt"))
        LOG.info("wrote %d sequences to %s in %.0fs", len(seqs), args.out, time.time() - t0)
        if not args.no_eval:
            print(evaluate(args.split_dir, seqs, args.out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
