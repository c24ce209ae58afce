"""5-year incident type-2 diabetes prediction from primary-care visit histories.

Hierarchical transformer: codes within a visit -> visit vector; visits -> patient vector.
Runs on a preemptible partition, so it checkpoints every N steps and resumes on restart
(torchrun --max-restarts re-executes the script, which picks up `latest.pt`).

    torchrun --nproc_per_node=8 --max-restarts=3 18_t2d_onset_hier_transformer_resume.py \
        --data /nfs/ehr/t2d_cohort --run_dir /nfs/ehr/runs/t2d_hier
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run_dir", required=True)
    p.add_argument("--max_visits", type=int, default=64)
    p.add_argument("--max_codes", type=int, default=32)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--visit_layers", type=int, default=2)
    p.add_argument("--patient_layers", type=int, default=4)
    p.add_argument("--bs", type=int, default=48)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--ckpt_every", type=int, default=1000)
    p.add_argument("--keep", type=int, default=3)
    return p.parse_args()


class Cohort(Dataset):
    def __init__(self, root, split):
        z = np.load(os.path.join(root, f"{split}.npz"))
        self.codes = z["codes"]            # [N, V, C] int32, 0 = pad
        self.age = z["age"]                # [N, V] float32, years at visit
        self.y = z["label"].astype(np.float32)
        self.vocab_size = int(z["vocab_size"])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return (torch.from_numpy(self.codes[i].astype(np.int64)), torch.from_numpy(self.age[i]),
                torch.tensor(self.y[i]), i)


def encoder(d, layers):
    layer = nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class HierTransformer(nn.Module):
    def __init__(self, vocab, d, visit_layers, patient_layers, max_visits):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.visit_enc = encoder(d, visit_layers)
        self.visit_pos = nn.Embedding(max_visits, d)
        self.age_proj = nn.Linear(1, d)
        self.patient_enc = encoder(d, patient_layers)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 1))

    def forward(self, codes, age):
        B, V, C = codes.shape
        flat = codes.view(B * V, C)
        code_pad = flat == 0
        empty = code_pad.all(1)
        code_pad[empty, 0] = False  # keep one slot so fully padded visits don't produce NaNs
        h = self.visit_enc(self.emb(flat), src_key_padding_mask=code_pad)
        keep = (~code_pad).unsqueeze(-1).float()
        visits = ((h * keep).sum(1) / keep.sum(1)).view(B, V, -1)
        visits = visits + self.visit_pos.weight[:V] + self.age_proj(age.unsqueeze(-1) / 100.0)
        x = torch.cat([self.cls.expand(B, -1, -1), visits], dim=1)
        vpad = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=codes.device), empty.view(B, V)], 1)
        z = self.patient_enc(x, src_key_padding_mask=vpad)[:, 0]
        return self.out(z).squeeze(-1)


def latest_checkpoint(run_dir):
    files = sorted(glob.glob(os.path.join(run_dir, "step_*.pt")))
    return files[-1] if files else None


def save(run_dir, keep, **state):
    path = os.path.join(run_dir, f"step_{state['step']:08d}.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    for old in sorted(glob.glob(os.path.join(run_dir, "step_*.pt")))[:-keep]:
        os.remove(old)


@torch.no_grad()
def val_auroc(model, ds, device, rank, world):
    model.eval()
    dl = DataLoader(ds, batch_size=256, sampler=DistributedSampler(ds, world, rank, shuffle=False), num_workers=2)
    p = torch.zeros(len(ds), device=device)
    for codes, age, _, i in dl:
        p[i.to(device)] = torch.sigmoid(model(codes.to(device), age.to(device)))
    dist.all_reduce(p, op=dist.ReduceOp.MAX)
    model.train()
    return roc_auc_score(ds.y, p.cpu().numpy())


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train, val = Cohort(args.data, "train"), Cohort(args.data, "val")
    sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    torch.manual_seed(0)
    model = HierTransformer(train.vocab_size, args.d, args.visit_layers, args.patient_layers,
                            args.max_visits).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    steps_per_epoch = len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch,
                                                pct_start=0.05)
    pos = float(train.y.mean())
    pos_weight = torch.tensor((1 - pos) / pos, device=device)

    os.makedirs(args.run_dir, exist_ok=True)
    step, best = 0, 0.0
    ck_path = latest_checkpoint(args.run_dir)
    if ck_path is not None:
        ck = torch.load(ck_path)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step, best = ck["step"], ck["best"]
        if rank == 0:
            print(f"resumed from {ck_path} at step {step}", flush=True)
        del ck

    start_epoch, skip = divmod(step, steps_per_epoch)
    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for b, (codes, age, y, _) in enumerate(loader):
            if epoch == start_epoch and b < skip:
                continue  # fast-forward to where the preempted run stopped
            codes, age, y = codes.to(device, non_blocking=True), age.to(device), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(codes, age), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0 and rank == 0:
                print(f"step {step} ep {epoch} loss {loss.item():.4f} {(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()
            if step % args.ckpt_every == 0:
                if rank == 0:
                    save(args.run_dir, args.keep, model=model.module.state_dict(), opt=opt.state_dict(),
                         sched=sched.state_dict(), step=step, best=best)
                dist.barrier()

        auc = val_auroc(model.module, val, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} val AUROC {auc:.4f}", flush=True)
            if auc > best:
                best = auc
                torch.save(model.module.state_dict(), os.path.join(args.run_dir, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
