"""
Build a FAISS index of CLIP image embeddings for a product gallery on a Slurm cluster,
then measure query->gallery Recall@K (a hit = same product_id).

Each Slurm task encodes its own slice of the gallery/queries; embeddings are
all-gathered (shards have different lengths, so they are padded to the longest first)
and rank 0 builds / writes the index.

    sbatch: #SBATCH --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8
    srun python 16_slurm_clip_gallery_index.py --gallery meta/gallery.csv --queries meta/queries.csv \
        --img-root /lustre/products --out /lustre/index/clip_l14
"""
import argparse
import os
import subprocess
import time

import faiss
import numpy as np
import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gallery", required=True, help="csv: image,product_id")
    ap.add_argument("--queries", default="", help="csv: image,product_id")
    ap.add_argument("--img-root", required=True)
    ap.add_argument("--arch", default="ViT-L-14")
    ap.add_argument("--pretrained", default="laion2b_s32b_b82k")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 5, 10])
    return ap.parse_args()


def init_slurm_dist():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    # with --gpus-per-task=1 each task only sees one device, otherwise it sees the whole node
    local_rank = int(os.environ["SLURM_LOCALID"]) % torch.cuda.device_count()
    if "MASTER_ADDR" not in os.environ:
        nodes = subprocess.check_output(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]).decode().split()
        os.environ["MASTER_ADDR"] = nodes[0]
    os.environ.setdefault("MASTER_PORT", str(15000 + int(os.environ["SLURM_JOB_ID"]) % 10000))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


class ImageCsv(Dataset):
    def __init__(self, df, root, preprocess, indices):
        self.paths = df["image"].tolist()
        self.root, self.preprocess, self.indices = root, preprocess, indices

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        j = self.indices[i]
        try:
            img = Image.open(os.path.join(self.root, self.paths[j])).convert("RGB")
        except OSError:
            img = Image.new("RGB", (224, 224))
        return self.preprocess(img), j


def all_gather_varlen(t, world_size):
    """all_gather for tensors whose first dim differs between ranks."""
    n = torch.tensor([t.shape[0]], device=t.device, dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    padded = t.new_zeros((max(sizes),) + tuple(t.shape[1:]))
    padded[: t.shape[0]] = t
    bufs = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(bufs, padded)
    return torch.cat([b[:s] for b, s in zip(bufs, sizes)], dim=0)


@torch.no_grad()
def encode_split(model, df, args, preprocess, rank, world_size, tag):
    # contiguous, unpadded shard; the last rank may get fewer images
    per = (len(df) + world_size - 1) // world_size
    my = list(range(rank * per, min(len(df), (rank + 1) * per)))
    loader = DataLoader(ImageCsv(df, args.img_root, preprocess, my), batch_size=args.batch_size,
                        num_workers=args.workers, pin_memory=True)
    feats, ids = [], []
    t0 = time.time()
    for i, (x, j) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            f = model.encode_image(x.cuda(non_blocking=True))
        feats.append(F.normalize(f.float(), dim=-1).half())
        ids.append(j.cuda())
        if rank == 0 and i % 50 == 0:
            print(f"[{tag}] {i}/{len(loader)} batches {time.time() - t0:.0f}s", flush=True)
    dim = model.visual.output_dim
    feats = torch.cat(feats) if feats else torch.empty(0, dim, device="cuda", dtype=torch.half)
    ids = torch.cat(ids) if ids else torch.empty(0, device="cuda", dtype=torch.long)
    feats = all_gather_varlen(feats, world_size)
    ids = all_gather_varlen(ids, world_size)
    order = torch.argsort(ids)
    return feats[order].float().cpu().numpy(), ids[order].cpu().numpy()


def main():
    args = parse_args()
    rank, world_size, local_rank = init_slurm_dist()
    # rank 0 fetches the weights into the shared cache first, the others load them afterwards
    if rank != 0:
        dist.barrier()
    model, _, preprocess = open_clip.create_model_and_transforms(args.arch, pretrained=args.pretrained)
    if rank == 0:
        dist.barrier()
    model = model.cuda().eval()

    gallery = pd.read_csv(args.gallery)
    g_feats, g_ids = encode_split(model, gallery, args, preprocess, rank, world_size, "gallery")
    q_feats = None
    if args.queries:
        queries = pd.read_csv(args.queries)
        q_feats, _ = encode_split(model, queries, args, preprocess, rank, world_size, "query")

    if rank == 0:
        assert len(g_ids) == len(gallery) and (g_ids == np.arange(len(gallery))).all()
        os.makedirs(args.out, exist_ok=True)
        index = faiss.IndexFlatIP(g_feats.shape[1])
        index.add(g_feats)
        faiss.write_index(index, os.path.join(args.out, "gallery.index"))
        gallery.to_csv(os.path.join(args.out, "gallery_meta.csv"), index=False)
        print(f"index built: {index.ntotal} vectors, dim {g_feats.shape[1]}", flush=True)

        if q_feats is not None:
            _, I = index.search(q_feats, max(args.ks))
            g_pid = gallery["product_id"].to_numpy()
            q_pid = queries["product_id"].to_numpy()
            hits = g_pid[I] == q_pid[:, None]
            for k in args.ks:
                print(f"Recall@{k}: {hits[:, :k].any(1).mean() * 100:.2f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
