"""Full-reference IQA on PIPAL (GAN-based distortions), LPIPS-style.

Reference and distorted image go through a shared VGG-16; channel-normalised
feature differences at 5 stages are weighted by learned 1x1 convs and spatially
averaged. Trained with MSE on Elo-normalised MOS + a hinge ranking term on
pairs that share the same reference.

    torchrun --nproc_per_node=8 17_pipal_fr_lpips_style.py --root /data/PIPAL
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.stats import kendalltau, pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models
from torchvision.transforms import functional as TF


def read_pipal_labels(label_dir, ref_names):
    items = []
    for ref in ref_names:
        with open(os.path.join(label_dir, ref.replace(".bmp", ".txt"))) as f:
            for line in f:
                dist_name, elo = line.strip().split(",")
                items.append((ref, dist_name, float(elo)))
    return items


class PIPALPairs(Dataset):
    def __init__(self, root, items, crop, train, elo_mean=1448.0, elo_std=121.0):
        self.root, self.items, self.crop, self.train = root, items, crop, train
        self.elo_mean, self.elo_std = elo_mean, elo_std
        self.ref_id = {r: k for k, r in enumerate(sorted({it[0] for it in items}))}

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ref, dis, elo = self.items[i]
        r = TF.to_tensor(Image.open(os.path.join(self.root, "Train_Ref", ref)).convert("RGB"))
        d = TF.to_tensor(Image.open(os.path.join(self.root, "Train_Dis", dis)).convert("RGB"))
        _, h, w = r.shape
        if self.train:
            y = np.random.randint(0, h - self.crop + 1)
            x = np.random.randint(0, w - self.crop + 1)
            r, d = r[:, y:y + self.crop, x:x + self.crop], d[:, y:y + self.crop, x:x + self.crop]
            if np.random.rand() < 0.5:
                r, d = r.flip(-1), d.flip(-1)
        score = (elo - self.elo_mean) / self.elo_std
        return r, d, torch.tensor(score, dtype=torch.float32), self.ref_id[ref], i


class LearnedFR(nn.Module):
    CHNS = (64, 128, 256, 512, 512)

    def __init__(self):
        super().__init__()
        feats = models.vgg16(weights=models.VGG16_Weights.IMAGENET1K_V1).features
        cut = [4, 9, 16, 23, 30]
        self.slices = nn.ModuleList([feats[a:b] for a, b in zip([0] + cut[:-1], cut)])
        self.lins = nn.ModuleList([nn.Sequential(nn.Dropout(0.2), nn.Conv2d(c, 1, 1, bias=False)) for c in self.CHNS])
        self.register_buffer("shift", torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1))
        self.out = nn.Linear(1, 1)

    def _feats(self, x):
        x = (x * 2 - 1 - self.shift) / self.scale
        out = []
        for s in self.slices:
            x = s(x)
            out.append(x / (x.norm(dim=1, keepdim=True) + 1e-10))
        return out

    def forward(self, ref, dis):
        fr, fd = self._feats(ref), self._feats(dis)
        d = sum(lin((a - b) ** 2).mean(dim=(2, 3)) for lin, a, b in zip(self.lins, fr, fd))
        return self.out(d).squeeze(-1)     # higher = better quality after the affine map


def same_ref_hinge(pred, score, ref_ids, margin=0.1):
    same = ref_ids[:, None] == ref_ids[None, :]
    diff = score[:, None] - score[None, :]
    valid = same & (diff > 0)
    if not valid.any():
        return pred.sum() * 0
    return F.relu(margin - (pred[:, None] - pred[None, :])[valid]).mean()


@torch.no_grad()
def gather_eval(model, loader, device, n):
    model.eval()
    rows = []
    for r, d, s, _, idx in loader:
        p = model(r.to(device, non_blocking=True), d.to(device, non_blocking=True))
        rows.append(torch.stack([p.float(), s.to(device), idx.to(device).float()], 1))
    rows = torch.cat(rows)
    all_rows = [torch.zeros_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(all_rows, rows)
    a = torch.cat(all_rows).cpu().numpy()
    _, k = np.unique(a[:, 2].astype(np.int64), return_index=True)
    a = a[k]
    assert len(a) == n
    model.train()
    return spearmanr(a[:, 0], a[:, 1])[0], pearsonr(a[:, 0], a[:, 1])[0], kendalltau(a[:, 0], a[:, 1])[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--rank-weight", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="work/pipal_fr")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    refs = sorted(os.listdir(os.path.join(args.root, "Train_Ref")))
    # fixed reference-level split: last 25 references are held out (val 15 / test 10)
    items = {"train": read_pipal_labels(os.path.join(args.root, "Train_Label"), refs[:-25]),
             "val": read_pipal_labels(os.path.join(args.root, "Train_Label"), refs[-25:-10]),
             "test": read_pipal_labels(os.path.join(args.root, "Train_Label"), refs[-10:])}
    train_set = PIPALPairs(args.root, items["train"], args.crop, True)
    val_set = PIPALPairs(args.root, items["val"], args.crop, False)
    test_set = PIPALPairs(args.root, items["test"], args.crop, False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=16, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = DDP(LearnedFR().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [30, 45], 0.1)
    best_path = os.path.join(args.out, "best.pth")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        stats = torch.zeros(3, device=device)
        for r, d, s, ref_id, _ in loader:
            r, d = r.to(device, non_blocking=True), d.to(device, non_blocking=True)
            s, ref_id = s.to(device), ref_id.to(device)
            p = model(r, d)
            l_mse = F.mse_loss(p, s)
            l_rank = same_ref_hinge(p, s, ref_id)
            loss = l_mse + args.rank_weight * l_rank
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            stats += torch.stack([l_mse.detach(), l_rank.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(stats)

        srcc, plcc, krcc = gather_eval(model, val_loader, device, len(val_set))
        if rank == 0:
            print(f"epoch {epoch}: mse {stats[0] / stats[2]:.4f} rank {stats[1] / stats[2]:.4f} "
                  f"val SRCC {srcc:.4f} PLCC {plcc:.4f} KRCC {krcc:.4f}", flush=True)
            if srcc > best:
                best = srcc
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    if rank == 0:
        net = LearnedFR().to(device)
        net.load_state_dict(torch.load(best_path, map_location=device))
        net.eval()
        preds, gts = [], []
        with torch.no_grad():
            for k in range(len(test_set)):
                r, d, s, _, _ = test_set[k]
                preds.append(net(r[None].to(device), d[None].to(device)).item())
                gts.append(s.item())
        print(f"TEST (best val {best:.4f}): SRCC {spearmanr(preds, gts)[0]:.4f} "
              f"PLCC {pearsonr(preds, gts)[0]:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
