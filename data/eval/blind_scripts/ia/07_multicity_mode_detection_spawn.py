"""Transport-mode detection on GPS segments pooled from several cities.

Every city was preprocessed separately (stay-point removal, 2 s resampling,
point features: speed, accel, jerk, bearing rate, dist-to-rail, dist-to-bus-stop)
into <root>/<city>/{train,test}.npz. Cities have very different sizes, so each
worker process reads only its own cities and the ranks run different numbers of
steps per epoch; DDP's Join context manager takes care of that.

    python 07_multicity_mode_detection_spawn.py --root /data/modes --world_size 4
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import classification_report, f1_score
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

MODES = ["walk", "bike", "bus", "car", "subway", "train"]
CITIES = ["beijing", "montreal", "london", "shenzhen", "seattle", "sao_paulo", "berlin"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/modes")
    p.add_argument("--cities", nargs="+", default=CITIES)
    p.add_argument("--world_size", type=int, default=4)
    p.add_argument("--master_port", type=int, default=29611)
    p.add_argument("--n_feat", type=int, default=6)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--out", default="runs/mode_detection")
    return p.parse_args()


def load_cities(root, cities, split):
    xs, lens, ys = [], [], []
    for c in cities:
        z = np.load(os.path.join(root, c, f"{split}.npz"))
        xs.append(z["x"].astype(np.float32))
        lens.append(z["length"].astype(np.int64))
        ys.append(z["y"].astype(np.int64))
    if not xs:
        return None
    return TensorDataset(torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(lens)),
                         torch.from_numpy(np.concatenate(ys)))


class ModeClassifier(nn.Module):
    def __init__(self, n_feat, d, layers, n_cls):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(n_feat, d), nn.LayerNorm(d), nn.GELU())
        self.conv = nn.Conv1d(d, d, kernel_size=5, padding=2, groups=d)
        self.gru = nn.GRU(d, d, num_layers=layers, batch_first=True, bidirectional=True, dropout=0.1)
        self.cls = nn.Sequential(nn.Linear(4 * d, d), nn.GELU(), nn.Dropout(0.2), nn.Linear(d, n_cls))

    def forward(self, x, length):
        h = self.inp(x)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h, _ = self.gru(h)
        mask = (torch.arange(x.size(1), device=x.device)[None] < length[:, None]).unsqueeze(-1)
        mean = (h * mask).sum(1) / mask.sum(1).clamp(min=1)
        mx = h.masked_fill(~mask, float("-inf")).amax(1)
        return self.cls(torch.cat([mean, mx], -1))


def gather_variable(t, world):
    """all_gather for 1-D tensors whose length differs per rank."""
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    buf = torch.zeros(max_n, dtype=t.dtype, device=t.device)
    buf[: t.numel()] = t
    out = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(out, buf)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


def run(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.master_port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    my_cities = args.cities[rank::world_size]
    train_ds = load_cities(args.root, my_cities, "train")
    test_ds = load_cities(args.root, my_cities, "test")
    assert train_ds is not None, f"rank {rank} got no city; use world_size <= {len(args.cities)}"
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=2,
                          pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=1024, shuffle=False)

    # class weights from the label counts of all cities, identical on every rank
    counts = torch.bincount(train_ds.tensors[2], minlength=len(MODES)).float().to(device)
    dist.all_reduce(counts)
    weights = (counts.sum() / (len(MODES) * counts.clamp(min=1))).sqrt()

    net = ModeClassifier(args.n_feat, args.d_model, args.layers, len(MODES)).to(device)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    print(f"[rank {rank}] cities={my_cities} train={len(train_ds)} test={len(test_ds)} "
          f"steps/epoch={len(train_dl)}", flush=True)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        with Join([model]):
            for x, length, y in train_dl:
                x, length, y = x.to(device, non_blocking=True), length.to(device), y.to(device)
                loss = F.cross_entropy(model(x, length), y, weight=weights, label_smoothing=0.05)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 2.0)
                opt.step()
                stats += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        sched.step()
        dist.all_reduce(stats)

        net.eval()
        preds, labels = [], []
        with torch.no_grad():
            for x, length, y in test_dl:
                preds.append(net(x.to(device), length.to(device)).argmax(-1))
                labels.append(y.to(device))
        net.train()
        all_pred = gather_variable(torch.cat(preds), world_size).cpu().numpy()
        all_true = gather_variable(torch.cat(labels), world_size).cpu().numpy()

        if rank == 0:
            f1 = f1_score(all_true, all_pred, average="macro")
            print(f"epoch {epoch:02d} loss {(stats[0] / stats[1]).item():.4f} macro-F1 {f1:.4f} "
                  f"n_test={len(all_true)} ({time.time() - t0:.0f}s)", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                torch.save({"model": net.state_dict(), "epoch": epoch, "modes": MODES},
                           os.path.join(args.out, "best.pt"))
                report = classification_report(all_true, all_pred, labels=list(range(len(MODES))),
                                               target_names=MODES, digits=3, zero_division=0)
                with open(os.path.join(args.out, "best_report.txt"), "w") as f:
                    f.write(report)
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = parse_args()
    assert args.world_size <= torch.cuda.device_count()
    mp.spawn(run, args=(args.world_size, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
