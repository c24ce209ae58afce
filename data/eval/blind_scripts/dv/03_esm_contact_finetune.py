"""Fine-tune the top of ESM-2 650M plus a small 2D head for residue-residue contacts.

Training set: PDB chains (40% identity clusters), one .npz per chain with
`seq` and `cb` (L, 3) C-beta coordinates (C-alpha for Gly); NaN for missing residues.
Reports long-range precision at L (|i-j| >= 24) on the CAMEO-like validation set.
"""
import argparse
import contextlib
import json
import os
import random
import time

import esm
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-list", required=True, help="text file, one npz path per line")
    p.add_argument("--valid-list", required=True)
    p.add_argument("--out-dir", default="checkpoints/esm2_contacts")
    p.add_argument("--crop", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--unfreeze-layers", type=int, default=4)
    p.add_argument("--lr-head", type=float, default=1e-3)
    p.add_argument("--lr-esm", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--contact-cutoff", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--wandb-project", default=None)
    return p.parse_args()


class ContactSet(Dataset):
    def __init__(self, list_file, cutoff, crop=None, train=False):
        with open(list_file) as fh:
            self.paths = [l.strip() for l in fh if l.strip()]
        self.cutoff, self.crop, self.train = cutoff, crop, train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        d = np.load(self.paths[i])
        seq, cb = str(d["seq"]), d["cb"].astype(np.float32)
        if self.train and self.crop and len(seq) > self.crop:
            s = random.randint(0, len(seq) - self.crop)
            seq, cb = seq[s:s + self.crop], cb[s:s + self.crop]
        dm = np.linalg.norm(cb[:, None] - cb[None], axis=-1)
        contacts = (dm < self.cutoff).astype(np.float32)
        contacts[np.isnan(dm)] = -1.0
        return os.path.basename(self.paths[i]), seq, torch.from_numpy(contacts)


class Collate:
    def __init__(self, alphabet):
        self.converter = alphabet.get_batch_converter()

    def __call__(self, batch):
        names, seqs, maps = zip(*batch)
        _, _, tokens = self.converter(list(zip(names, seqs)))
        L = max(len(s) for s in seqs)
        target = torch.full((len(seqs), L, L), -1.0)
        for i, m in enumerate(maps):
            target[i, : m.shape[0], : m.shape[1]] = m
        return tokens, target, torch.tensor([len(s) for s in seqs])


class ContactModel(nn.Module):
    def __init__(self, esm_model, n_layers_total, d_pair=64):
        super().__init__()
        self.esm = esm_model
        self.repr_layer = n_layers_total
        d = esm_model.embed_dim
        self.proj = nn.Linear(d, d_pair)
        self.pair = nn.Sequential(
            nn.Conv2d(2 * d_pair, 64, 3, padding=1), nn.GELU(),
            nn.Conv2d(64, 64, 3, padding=2, dilation=2), nn.GELU(),
            nn.Conv2d(64, 1, 1),
        )

    def forward(self, tokens):
        out = self.esm(tokens, repr_layers=[self.repr_layer])
        h = out["representations"][self.repr_layer][:, 1:-1]   # drop BOS / EOS
        z = self.proj(h)
        L = z.size(1)
        pair = torch.cat([z[:, :, None].expand(-1, -1, L, -1), z[:, None].expand(-1, L, -1, -1)], -1)
        logits = self.pair(pair.permute(0, 3, 1, 2)).squeeze(1)
        return 0.5 * (logits + logits.transpose(1, 2))


def contact_loss(logits, target, min_sep=6):
    L = target.size(-1)
    logits = logits[:, :L, :L]
    idx = torch.arange(L, device=target.device)
    sep = (idx[None] - idx[:, None]).abs()
    mask = (target >= 0) & (sep >= min_sep)[None]
    return F.binary_cross_entropy_with_logits(logits[mask], target[mask])


@torch.no_grad()
def precision_at_L(model, loader, device, min_sep=24):
    model.eval()
    stats = torch.zeros(2, device=device)   # sum of per-protein precision, number of proteins
    for tokens, target, lengths in loader:
        tokens, target = tokens.to(device), target.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            probs = torch.sigmoid(model(tokens).float())
        for b in range(tokens.size(0)):
            L = int(lengths[b])
            p, t = probs[b, :L, :L], target[b, :L, :L]
            i, j = torch.triu_indices(L, L, offset=min_sep, device=device)
            pv, tv = p[i, j], t[i, j]
            keep = tv >= 0
            pv, tv = pv[keep], tv[keep]
            if tv.numel() == 0:
                continue
            k = min(L, pv.numel())
            top = pv.topk(k).indices
            stats[0] += tv[top].mean()
            stats[1] += 1
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1].clamp_min(1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    # rank 0 fills the torch.hub cache first, the others then read the finished file
    if rank == 0:
        esm_model, alphabet = esm.pretrained.esm2_t33_650M_UR50D()
    dist.barrier()
    if rank != 0:
        esm_model, alphabet = esm.pretrained.esm2_t33_650M_UR50D()

    n_layers = esm_model.num_layers
    for p in esm_model.parameters():
        p.requires_grad = False
    for layer in esm_model.layers[n_layers - args.unfreeze_layers:]:
        for p in layer.parameters():
            p.requires_grad = True
    for p in esm_model.emb_layer_norm_after.parameters():
        p.requires_grad = True

    model = ContactModel(esm_model, n_layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    head_params = [p for n, p in model.module.named_parameters() if not n.startswith("esm.") and p.requires_grad]
    esm_params = [p for n, p in model.module.named_parameters() if n.startswith("esm.") and p.requires_grad]
    opt = torch.optim.AdamW([{"params": head_params, "lr": args.lr_head},
                             {"params": esm_params, "lr": args.lr_esm}], weight_decay=0.01)

    collate = Collate(alphabet)
    train_ds = ContactSet(args.train_list, args.contact_cutoff, crop=args.crop, train=True)
    valid_all = ContactSet(args.valid_list, args.contact_cutoff)
    valid_ds = Subset(valid_all, range(rank, len(valid_all), world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=1, collate_fn=collate, num_workers=2)

    run = None
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        if args.wandb_project:
            run = wandb.init(project=args.wandb_project, config=vars(args))
    trainable = {n for n, p in model.module.named_parameters() if p.requires_grad}
    scaler = torch.cuda.amp.GradScaler()
    best, step = 0.0, 0

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (tokens, target, _) in enumerate(train_loader):
            tokens, target = tokens.to(device, non_blocking=True), target.to(device, non_blocking=True)
            last_micro = (it + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(tokens)
                loss = contact_loss(logits.float(), target) / args.accum
                scaler.scale(loss).backward()
            if last_micro:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                step += 1
                if run is not None and step % 20 == 0:
                    run.log({"train/loss": loss.item() * args.accum, "step": step})

        p_at_l = precision_at_L(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: long-range P@L {p_at_l:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if run is not None:
                run.log({"valid/P@L_long": p_at_l, "epoch": epoch})
            if p_at_l > best:
                best = p_at_l
                sd = {k: v for k, v in model.module.state_dict().items() if k in trainable}
                torch.save({"state_dict": sd, "epoch": epoch, "P@L": best, "args": vars(args)},
                           os.path.join(args.out_dir, "best_trainable.pt"))
            with open(os.path.join(args.out_dir, "history.jsonl"), "a") as fh:
                fh.write(json.dumps({"epoch": epoch, "p_at_l": p_at_l}) + "\n")
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
