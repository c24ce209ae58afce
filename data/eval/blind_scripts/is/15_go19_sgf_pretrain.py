"""Go 19x19 policy/value pretraining from professional SGF games.

The SGF collection is parsed once into a packed .npz cache next to the data,
later runs reuse it.  The trained net seeds generation 0 of the self-play loop.

    torchrun --nproc_per_node=8 go19_sgf_pretrain.py --sgf-dir /data/go/pro_sgf --out runs/go19_sl
"""
import argparse
import glob
import hashlib
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sgfmill import boards, sgf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

SZ = 19
PLANES = 8  # own stones, opp stones, empty, own/opp last 2 moves, ones, komi sign


def encode(board, to_play, last_moves):
    x = np.zeros((PLANES, SZ, SZ), np.uint8)
    opp = "w" if to_play == "b" else "b"
    for r in range(SZ):
        for c in range(SZ):
            s = board.get(r, c)
            if s == to_play:
                x[0, r, c] = 1
            elif s == opp:
                x[1, r, c] = 1
            else:
                x[2, r, c] = 1
    for k, (col, mv) in enumerate(last_moves[-4:]):
        if mv is not None:
            x[3 + k, mv[0], mv[1]] = 1
    x[7] = 1
    return x


def parse_game(path):
    with open(path, "rb") as f:
        g = sgf.Sgf_game.from_bytes(f.read())
    if g.get_size() != SZ:
        return None
    winner = g.get_winner()
    if winner is None:
        return None
    board = boards.Board(SZ)
    ab, aw, _ = g.get_root().get_setup_stones()
    for r, c in ab:
        board.play(r, c, "b")
    for r, c in aw:
        board.play(r, c, "w")
    xs, ys, zs, last = [], [], [], []
    for node in g.get_main_sequence()[1:]:
        colour, mv = node.get_move()
        if colour is None:
            continue
        xs.append(encode(board, colour, last))
        ys.append(SZ * SZ if mv is None else mv[0] * SZ + mv[1])
        zs.append(1 if colour == winner else -1)
        if mv is not None:
            try:
                board.play(mv[0], mv[1], colour)
            except ValueError:
                return None
        last.append((colour, mv))
    return np.stack(xs) if xs else None, np.array(ys, np.int16), np.array(zs, np.int8)


def build_cache(sgf_dir, cache_path, val_every=50):
    files = sorted(glob.glob(os.path.join(sgf_dir, "**", "*.sgf"), recursive=True))
    tr, va = ([], [], []), ([], [], [])
    for f in tqdm(files, desc="parsing sgf", mininterval=10):
        try:
            out = parse_game(f)
        except Exception:
            continue
        if out is None or out[0] is None:
            continue
        # split by game, deterministically from the file name
        h = int(hashlib.md5(os.path.basename(f).encode()).hexdigest(), 16)
        dst = va if h % val_every == 0 else tr
        for lst, arr in zip(dst, out):
            lst.append(arr)
    np.savez(cache_path,
             train_x=np.packbits(np.concatenate(tr[0]), axis=-1), train_y=np.concatenate(tr[1]),
             train_z=np.concatenate(tr[2]),
             val_x=np.packbits(np.concatenate(va[0]), axis=-1), val_y=np.concatenate(va[1]),
             val_z=np.concatenate(va[2]))


class Positions(Dataset):
    def __init__(self, x, y, z, augment):
        self.x, self.y, self.z, self.augment = x, y, z, augment

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = np.unpackbits(self.x[i], axis=-1)[..., :SZ].astype(np.float32)
        y = int(self.y[i])
        if self.augment:
            k, flip = np.random.randint(4), np.random.randint(2)
            x = np.rot90(x, k, axes=(1, 2))
            if y < SZ * SZ:
                m = np.zeros((SZ, SZ), np.uint8)
                m[divmod(y, SZ)] = 1
                m = np.rot90(m, k)
                if flip:
                    m = m[:, ::-1]
                y = int(m.argmax())
            if flip:
                x = x[:, :, ::-1]
        return torch.from_numpy(np.ascontiguousarray(x)), y, float(self.z[i])


class PolicyValueNet(nn.Module):
    def __init__(self, blocks=12, ch=192):
        super().__init__()
        self.inp = nn.Sequential(nn.Conv2d(PLANES, ch, 5, padding=2, bias=False), nn.BatchNorm2d(ch), nn.ReLU())
        self.res = nn.Sequential(*[nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch),
                                                 nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1, bias=False),
                                                 nn.BatchNorm2d(ch)) for _ in range(blocks)])
        self.pol = nn.Conv2d(ch, 2, 1)
        self.pol_fc = nn.Linear(2 * SZ * SZ, SZ * SZ + 1)
        self.val = nn.Sequential(nn.Conv2d(ch, 1, 1), nn.ReLU(), nn.Flatten(), nn.Linear(SZ * SZ, 256),
                                 nn.ReLU(), nn.Linear(256, 1), nn.Tanh())

    def forward(self, x):
        h = self.inp(x)
        for blk in self.res:
            h = F.relu(h + blk(h))
        return self.pol_fc(F.relu(self.pol(h)).flatten(1)), self.val(h).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sgf-dir", required=True)
    ap.add_argument("--cache", default=None, help="defaults to <sgf-dir>/positions_v2.npz")
    ap.add_argument("--out", default="runs/go19_sl")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    cache = args.cache or os.path.join(args.sgf_dir, "positions_v2.npz")
    if not os.path.exists(cache):
        build_cache(args.sgf_dir, cache)
    d = np.load(cache)
    train_ds = Positions(d["train_x"], d["train_y"], d["train_z"], augment=True)
    val_ds = Positions(d["val_x"], d["val_y"], d["val_z"], augment=False)

    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=tr_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, worker_init_fn=lambda w: np.random.seed(
                              (torch.initial_seed() + w) % 2**32))
    val_dl = DataLoader(val_ds, args.batch_size, sampler=va_sampler, num_workers=args.workers, pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(PolicyValueNet()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train positions {len(train_ds)} val {len(val_ds)}", flush=True)

    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y, z) in enumerate(train_dl):
            x, y, z = x.to(device, non_blocking=True), y.to(device, non_blocking=True), z.float().to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, v = model(x)
                loss = F.cross_entropy(logits.float(), y) + 0.25 * F.mse_loss(v.float(), z)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 500 == 0:
                print(f"ep {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        model.eval()
        tot = torch.zeros(4, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y, z in val_dl:
                x, y, z = x.to(device), y.to(device), z.float().to(device)
                logits, v = model(x)
                tot += torch.stack([F.cross_entropy(logits, y, reduction="sum"),
                                    (logits.argmax(1) == y).sum(),
                                    F.mse_loss(v, z, reduction="sum"),
                                    torch.tensor(float(len(y)), device=device)]).double()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch}: val CE {tot[0] / tot[3]:.4f} acc {tot[1] / tot[3]:.4f} "
                  f"mse {tot[2] / tot[3]:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.out, f"sl_{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
