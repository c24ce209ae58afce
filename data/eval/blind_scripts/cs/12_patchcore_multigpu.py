"""PatchCore, multi-GPU: sharded feature extraction, one global coreset, sharded test scoring.

Image and pixel AUROC are computed on rank 0 over the *whole* test set after gathering the
per-rank scores (each test image is scored exactly once).

    torchrun --nproc_per_node=4 12_patchcore_multigpu.py --category transistor --coreset 0.01
"""
import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from scipy.ndimage import gaussian_filter
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torchvision import models, transforms as T


class Folder(Dataset):
    def __init__(self, root, category, split, size=224):
        self.base = Path(root) / category
        self.files = sorted((self.base / split).glob("*/*.png"))
        self.tf = T.Compose([T.Resize((size, size)), T.ToTensor(),
                             T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.size = size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        f = self.files[i]
        x = self.tf(Image.open(f).convert("RGB"))
        if f.parent.name == "good":
            m = np.zeros((self.size, self.size), np.uint8)
        else:
            gt = Image.open(self.base / "ground_truth" / f.parent.name / f"{f.stem}_mask.png")
            m = (np.asarray(gt.resize((self.size, self.size), Image.NEAREST)) > 127).astype(np.uint8)
        return x, torch.from_numpy(m), int(f.parent.name != "good"), i


class WRN50Patches(torch.nn.Module):
    def __init__(self, out_dim=1024):
        super().__init__()
        net = models.wide_resnet50_2(weights=models.Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.to_l2 = torch.nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2)
        self.l3 = net.layer3
        self.out_dim = out_dim

    @torch.no_grad()
    def forward(self, x):
        f2 = self.to_l2(x)
        f3 = self.l3(f2)
        f2 = F.avg_pool2d(f2, 3, 1, 1)
        f3 = F.interpolate(F.avg_pool2d(f3, 3, 1, 1), size=f2.shape[-2:], mode="bilinear", align_corners=False)
        f = torch.cat([f2, f3], 1)
        b, c, h, w = f.shape
        f = f.permute(0, 2, 3, 1).reshape(b * h * w, 1, c)
        return F.adaptive_avg_pool1d(f, self.out_dim).squeeze(1), (h, w)


def all_gather_varlen(t):
    """all_gather for tensors whose first dimension differs between ranks."""
    world = dist.get_world_size()
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    padded = torch.zeros((max(sizes),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def kcenter_greedy(x, n, proj_dim=128, seed=0):
    torch.manual_seed(seed)
    z = x @ (torch.randn(x.shape[1], proj_dim, device=x.device) / proj_dim ** 0.5)
    idx = [0]
    d = torch.cdist(z, z[:1]).squeeze(1)
    for _ in range(n - 1):
        i = int(d.argmax())
        idx.append(i)
        d = torch.minimum(d, torch.cdist(z, z[i:i + 1]).squeeze(1))
    return torch.tensor(idx, device=x.device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/mvtec_ad")
    ap.add_argument("--category", default="transistor")
    ap.add_argument("--coreset", type=float, default=0.01)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--outdir", default="results/patchcore_mg")
    ap.add_argument("--bank", default=None, help="reuse a saved memory bank")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    model = WRN50Patches().to(dev).eval()
    outdir = Path(args.outdir) / args.category
    bank_path = Path(args.bank) if args.bank else outdir / "memory_bank.pt"

    if args.bank:
        bank = torch.load(bank_path, map_location=dev)["bank"]
    else:
        train = Folder(args.root, args.category, "train")
        my_idx = list(range(rank, len(train), world))  # uneven shards are fine: gathered with padding
        feats = []
        for s in range(0, len(my_idx), args.bs):
            x = torch.stack([train[i][0] for i in my_idx[s:s + args.bs]]).to(dev)
            feats.append(model(x)[0])
        feats = all_gather_varlen(torch.cat(feats))

        n_sel = max(1, int(args.coreset * len(feats)))
        if rank == 0:
            sel = kcenter_greedy(feats, n_sel)
        else:
            sel = torch.empty(n_sel, dtype=torch.long, device=dev)
        dist.broadcast(sel, src=0)
        bank = feats[sel].contiguous()
        del feats
        if rank == 0:
            outdir.mkdir(parents=True, exist_ok=True)
            tmp = bank_path.with_suffix(".tmp")
            torch.save({"bank": bank.cpu(), "category": args.category}, tmp)
            os.replace(tmp, bank_path)
        dist.barrier()

    test = Folder(args.root, args.category, "test")
    loader = DataLoader(torch.utils.data.Subset(test, range(rank, len(test), world)),
                        batch_size=args.bs, num_workers=4)
    local = {"idx": [], "img": [], "map": []}
    for x, _, _, idx in loader:
        f, (h, w) = model(x.to(dev))
        d = torch.cdist(f, bank).topk(args.k, largest=False).values.mean(1).view(len(x), 1, h, w)
        amap = F.interpolate(d, size=x.shape[-2:], mode="bilinear", align_corners=False).squeeze(1).cpu().numpy()
        amap = np.stack([gaussian_filter(a, sigma=4) for a in amap])
        local["idx"].append(idx.numpy())
        local["img"].append(d.flatten(1).max(1).values.cpu().numpy())
        local["map"].append(amap.astype(np.float16))
    local = {k: np.concatenate(v) for k, v in local.items()}

    gathered = [None] * world if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if rank == 0:
        idx = np.concatenate([g["idx"] for g in gathered])
        order = np.argsort(idx)
        assert len(idx) == len(test) and (idx[order] == np.arange(len(test))).all()
        img_scores = np.concatenate([g["img"] for g in gathered])[order]
        maps = np.concatenate([g["map"] for g in gathered])[order].astype(np.float32)
        labels = np.array([int(f.parent.name != "good") for f in test.files])
        masks = np.stack([test[i][1].numpy() for i in range(len(test))])
        res = {"category": args.category, "image_auroc": float(roc_auc_score(labels, img_scores)),
               "pixel_auroc": float(roc_auc_score(masks.ravel(), maps.ravel())), "bank": int(bank.shape[0]),
               "world_size": world}
        print(json.dumps(res), flush=True)
        outdir.mkdir(parents=True, exist_ok=True)
        (outdir / "metrics.json").write_text(json.dumps(res, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
