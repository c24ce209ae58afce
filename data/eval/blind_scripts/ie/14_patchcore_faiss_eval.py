"""PatchCore fit + sharded evaluation with a faiss nearest-neighbour index.

Fitting: every rank embeds its shard of nominal images, the shards are
gathered and rank 0 subsamples the coreset and writes bank.npy. Evaluation:
every rank loads the bank into a faiss index and scores its shard of the test
images; scores and anomaly maps are gathered for image/pixel AUROC and PRO.

    torchrun --nproc_per_node=4 patchcore_faiss.py --data /data/mvtec_like/injection_mold \
        --category lid_c --out /models/patchcore
"""
import argparse
import os
import time
from pathlib import Path

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from scipy.ndimage import gaussian_filter
from skimage import measure
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--category", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resize", type=int, default=256)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--coreset", type=float, default=0.01)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=8)
    return ap.parse_args()


class ADSet(Dataset):
    def __init__(self, root, split, resize, crop):
        self.items = []
        for d in sorted((root / split).iterdir()):
            for f in sorted(d.glob("*.png")):
                m = root / "ground_truth" / d.name / f"{f.stem}_mask.png"
                self.items.append((str(f), str(m) if m.exists() else "", int(d.name != "good")))
        self.tf = transforms.Compose([transforms.Resize(resize), transforms.CenterCrop(crop), transforms.ToTensor(),
                                      transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.mtf = transforms.Compose([transforms.Resize(resize, transforms.InterpolationMode.NEAREST),
                                       transforms.CenterCrop(crop), transforms.ToTensor()])
        self.crop = crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, m, y = self.items[i]
        mask = self.mtf(Image.open(m))[0] > 0.5 if m else torch.zeros(self.crop, self.crop, dtype=torch.bool)
        return self.tf(Image.open(f).convert("RGB")), mask, y, i


class WRN50Patches(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        m = models.wide_resnet50_2(weights=models.Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.f = torch.nn.ModuleList([torch.nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool, m.layer1, m.layer2),
                                      m.layer3])
        self.dim = dim

    @torch.no_grad()
    def forward(self, x):
        a = self.f[0](x)
        b = self.f[1](a)
        a = F.avg_pool2d(a, 3, 1, 1)
        b = F.interpolate(F.avg_pool2d(b, 3, 1, 1), size=a.shape[-2:], mode="bilinear", align_corners=False)
        z = torch.cat([a, b], 1)
        n, c, h, w = z.shape
        z = F.adaptive_avg_pool1d(z.permute(0, 2, 3, 1).reshape(-1, 1, c), self.dim).reshape(n, h, w, self.dim)
        return z


def coreset_select(x, n, seed=0):
    g = torch.Generator(device=x.device).manual_seed(seed)
    z = x @ torch.randn(x.shape[1], 128, device=x.device, generator=g)
    idx = [int(torch.randint(len(z), (1,), generator=g, device=x.device))]
    dmin = (z - z[idx[0]]).pow(2).sum(1)
    for _ in range(n - 1):
        j = int(dmin.argmax())
        idx.append(j)
        dmin = torch.minimum(dmin, (z - z[j]).pow(2).sum(1))
    return x[idx]


def build_index(bank):
    res = faiss.StandardGpuResources()
    index = faiss.IndexFlatL2(bank.shape[1])
    index = faiss.index_cpu_to_gpu(res, 0, index)
    index.add(bank)
    return index, res


def pro(masks, amaps, limit=0.3, n=200):
    comps = [(i, r.coords) for i, m in enumerate(masks) for r in measure.regionprops(measure.label(m))]
    neg = ~masks
    xs, ys = [], []
    for th in np.linspace(amaps.min(), amaps.max(), n):
        pred = amaps > th
        xs.append(np.logical_and(pred, neg).sum() / neg.sum())
        ys.append(np.mean([pred[i][c[:, 0], c[:, 1]].mean() for i, c in comps]) if comps else 0.0)
    xs, ys = np.array(xs), np.array(ys)
    sel = xs <= limit
    o = np.argsort(xs[sel])
    return float(np.trapz(ys[sel][o], xs[sel][o]) / limit)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    root = Path(args.data) / args.category
    out = Path(args.out) / args.category
    model = WRN50Patches(args.dim).to(dev).eval()

    # ---------------- fit ----------------
    t0 = time.time()
    train = ADSet(root, "train", args.resize, args.crop)
    feats = []
    for x, _, _, _ in DataLoader(train, batch_size=args.batch_size, num_workers=4,
                                 sampler=DistributedSampler(train, shuffle=False)):
        feats.append(model(x.to(dev)).reshape(-1, args.dim))
    feats = torch.cat(feats)
    allf = [torch.empty_like(feats) for _ in range(world)]
    dist.all_gather(allf, feats)
    if rank == 0:
        allf = torch.cat(allf)
        bank = coreset_select(allf, int(len(allf) * args.coreset))
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / "bank.npy", bank.cpu().numpy().astype(np.float32))
        print(f"bank {tuple(bank.shape)} from {len(allf)} patches in {time.time() - t0:.0f}s", flush=True)
    del allf, feats
    torch.cuda.empty_cache()
    dist.barrier()

    # ---------------- evaluate ----------------
    bank = np.load(out / "bank.npy")
    index, _res = build_index(bank)
    test = ADSet(root, "test", args.resize, args.crop)
    results = []
    for x, m, y, idx in DataLoader(test, batch_size=args.batch_size, num_workers=4,
                                   sampler=DistributedSampler(test, shuffle=False)):
        z = model(x.to(dev))
        n, h, w, c = z.shape
        dists, _ = index.search(z.reshape(-1, c).cpu().numpy(), args.k)
        amap = torch.from_numpy(np.sqrt(dists.mean(1))).reshape(n, 1, h, w)
        amap = F.interpolate(amap, size=args.crop, mode="bilinear", align_corners=False)[:, 0].numpy()
        for k in range(n):
            a = gaussian_filter(amap[k], sigma=4)
            results.append((int(idx[k]), int(y[k]), float(a.max()), a.astype(np.float16), m[k].numpy()))
    everything = [None] * world
    dist.all_gather_object(everything, results)

    if rank == 0:
        seen = {}
        for part in everything:
            for r in part:
                seen.setdefault(r[0], r)
        rows = [seen[i] for i in sorted(seen)]
        y = np.array([r[1] for r in rows])
        s = np.array([r[2] for r in rows])
        amaps = np.stack([r[3] for r in rows]).astype(np.float32)
        masks = np.stack([r[4] for r in rows])
        print(f"{args.category}: image AUROC {roc_auc_score(y, s):.4f}  "
              f"pixel AUROC {roc_auc_score(masks.ravel(), amaps.ravel()):.4f}  PRO {pro(masks, amaps):.4f}  "
              f"({len(rows)} test images)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
