"""Train a 2-D ResNet contact head on frozen ESM-2 attention maps.

Data: a directory of .npz files (one per PDB chain) with `seq` and `cb_dist` (L x L, Angstrom),
plus train/valid list files. Reports long-range P@L and long-range AUPR on the validation chains.

    torchrun --nproc_per_node=8 05_contact_head_finetune.py --npz_dir /data/pdb_chains \
        --train_list splits/train.txt --valid_list splits/valid.txt
"""
import argparse
import os

import esm
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CONTACT_CUTOFF = 8.0
MIN_SEP_LONG = 24


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--npz_dir", required=True)
    p.add_argument("--train_list", required=True)
    p.add_argument("--valid_list", required=True)
    p.add_argument("--esm", default="esm2_t33_650M_UR50D")
    p.add_argument("--crop", type=int, default=400)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save", default="runs/contact_head")
    return p.parse_args()


class ChainDataset(Dataset):
    def __init__(self, npz_dir, list_file, crop=None):
        with open(list_file) as fh:
            self.ids = [l.strip() for l in fh if l.strip()]
        self.npz_dir, self.crop = npz_dir, crop

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.npz_dir, self.ids[i] + ".npz"))
        seq, dist_map = str(d["seq"]), d["cb_dist"].astype(np.float32)
        if self.crop and len(seq) > self.crop:
            s = np.random.randint(0, len(seq) - self.crop + 1)
            seq, dist_map = seq[s:s + self.crop], dist_map[s:s + self.crop, s:s + self.crop]
        return self.ids[i], seq, dist_map


def make_collate(batch_converter):
    def collate(batch):
        names, seqs, dmaps = zip(*batch)
        _, _, tokens = batch_converter(list(zip(names, seqs)))
        L = max(len(s) for s in seqs)
        target = torch.full((len(seqs), L, L), -1.0)  # -1 = unknown / padding
        for k, d in enumerate(dmaps):
            n = d.shape[0]
            t = torch.from_numpy(d)
            target[k, :n, :n] = torch.where(torch.isnan(t), torch.full_like(t, -1.0),
                                            (t < CONTACT_CUTOFF).float())
        return tokens, target, torch.tensor([len(s) for s in seqs])
    return collate


class ResBlock2d(nn.Module):
    def __init__(self, c, dilation):
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=dilation, dilation=dilation)
        self.c2 = nn.Conv2d(c, c, 3, padding=dilation, dilation=dilation)
        self.n1, self.n2 = nn.InstanceNorm2d(c, affine=True), nn.InstanceNorm2d(c, affine=True)

    def forward(self, x):
        h = F.elu(self.n1(self.c1(x)))
        return F.elu(x + self.n2(self.c2(h)))


class ContactModel(nn.Module):
    def __init__(self, lm, n_attn, channels=64, blocks=8):
        super().__init__()
        self.lm = lm
        for p in self.lm.parameters():
            p.requires_grad_(False)
        self.proj = nn.Conv2d(n_attn, channels, 1)
        self.blocks = nn.Sequential(*[ResBlock2d(channels, 2 ** (b % 4)) for b in range(blocks)])
        self.out = nn.Conv2d(channels, 1, 1)

    @staticmethod
    def apc(x):
        a1, a2 = x.sum(-1, keepdim=True), x.sum(-2, keepdim=True)
        return x - a1 * a2 / x.sum((-1, -2), keepdim=True)

    def forward(self, tokens):
        with torch.no_grad():
            attn = self.lm(tokens, need_head_weights=True)["attentions"]  # B, layers, heads, T, T
        B, Ly, H, T, _ = attn.shape
        attn = attn[..., 1:-1, 1:-1].reshape(B, Ly * H, T - 2, T - 2)
        attn = self.apc(attn + attn.transpose(-1, -2))
        x = self.blocks(self.proj(attn))
        logits = self.out(x).squeeze(1)
        return 0.5 * (logits + logits.transpose(-1, -2))


def long_range_mask(L, device):
    i = torch.arange(L, device=device)
    return (i[None, :] - i[:, None]) >= MIN_SEP_LONG


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    pl_sum = torch.zeros(2, device=device)
    all_scores, all_labels = [], []
    for tokens, target, lengths in loader:
        tokens, target = tokens.to(device), target.to(device)
        probs = torch.sigmoid(model(tokens).float())
        for k, L in enumerate(lengths.tolist()):
            p, t = probs[k, :L, :L], target[k, :L, :L]
            m = long_range_mask(L, device) & (t >= 0)
            ps, ts = p[m], t[m]
            if ts.numel() == 0:
                continue
            top = torch.topk(ps, min(L, ps.numel())).indices
            pl_sum[0] += ts[top].mean()
            pl_sum[1] += 1
            all_scores.append(ps)
            all_labels.append(ts)
    dist.all_reduce(pl_sum)
    scores, labels = torch.cat(all_scores), torch.cat(all_labels)
    world = dist.get_world_size()
    g_scores = [torch.zeros_like(scores) for _ in range(world)]
    g_labels = [torch.zeros_like(labels) for _ in range(world)]
    dist.all_gather(g_scores, scores)
    dist.all_gather(g_labels, labels)
    model.train()
    aupr = average_precision_score(torch.cat(g_labels).cpu().numpy(), torch.cat(g_scores).cpu().numpy())
    return (pl_sum[0] / pl_sum[1]).item(), aupr


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    lm, alphabet = esm.pretrained.load_model_and_alphabet(args.esm)
    lm = lm.eval().to(device)
    model = ContactModel(lm, lm.num_layers * lm.attention_heads).to(device)
    model = DDP(model, device_ids=[local_rank])

    collate = make_collate(alphabet.get_batch_converter())
    train_ds = ChainDataset(args.npz_dir, args.train_list, crop=args.crop)
    valid_ds = ChainDataset(args.npz_dir, args.valid_list, crop=1022)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    valid_loader = DataLoader(valid_ds, batch_size=1, sampler=DistributedSampler(valid_ds, shuffle=False),
                              collate_fn=collate, num_workers=2)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))
    os.makedirs(args.save, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for step, (tokens, target, _) in enumerate(train_loader):
            tokens, target = tokens.to(device), target.to(device)
            logits = model(tokens)
            known = target >= 0
            loss = F.binary_cross_entropy_with_logits(logits[known], target[known], pos_weight=torch.tensor(5.0, device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} it {step} bce {loss.item():.4f}", flush=True)

        p_at_l, aupr = validate(model, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: long-range P@L {p_at_l:.4f}  AUPR {aupr:.4f}", flush=True)
            if p_at_l > best:
                best = p_at_l
                head = {k: v for k, v in model.module.state_dict().items() if not k.startswith("lm.")}
                torch.save({"head": head, "epoch": epoch, "p_at_l": p_at_l}, os.path.join(args.save, "best_head.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
