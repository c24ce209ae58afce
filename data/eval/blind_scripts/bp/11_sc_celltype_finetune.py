"""Cell-type annotation: fine-tune a pretrained gene-token transformer on a labelled h5ad.

Each cell is encoded as (gene token, binned expression) pairs for its top-expressed genes;
the [CLS] embedding feeds a linear classifier. Reports accuracy, macro-F1 and macro AUROC.

    torchrun --nproc_per_node=4 11_sc_celltype_finetune.py --h5ad data/pbmc_annotated.h5ad \
        --vocab runs/sc_encoder_pretrain/gene_vocab.json --pretrained runs/sc_encoder_pretrain/encoder.pt
"""
import argparse
import json
import os

import anndata as ad
import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

PAD, CLS = 0, 2
N_BINS = 51


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5ad", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--pretrained", default=None)
    ap.add_argument("--label_key", default="cell_type")
    ap.add_argument("--max_genes", type=int, default=1200)
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--out", default="runs/celltype")
    return ap.parse_args()


class CellDataset(Dataset):
    def __init__(self, X, gene_ids, labels, max_genes):
        self.X, self.gene_ids, self.labels, self.max_genes = X, gene_ids, labels, max_genes

    def __len__(self):
        return self.X.shape[0]

    def __getitem__(self, i):
        row = self.X[i]
        idx, val = row.indices, row.data
        if len(idx) > self.max_genes - 1:
            top = np.argpartition(-val, self.max_genes - 1)[: self.max_genes - 1]
            idx, val = idx[top], val[top]
        # per-cell quantile binning of log-normalised expression (scGPT style)
        edges = np.quantile(val, np.linspace(0, 1, N_BINS - 1)) if len(val) else np.zeros(1)
        bins = np.digitize(val, edges[1:-1]) + 1
        genes = np.concatenate([[CLS], self.gene_ids[idx]])
        values = np.concatenate([[0], bins])
        return torch.from_numpy(genes).long(), torch.from_numpy(values).long(), int(self.labels[i]), i


def collate(batch):
    genes, values, labels, idx = zip(*batch)
    L = max(len(g) for g in genes)
    G = torch.full((len(batch), L), PAD, dtype=torch.long)
    V = torch.zeros((len(batch), L), dtype=torch.long)
    for k, (g, v) in enumerate(zip(genes, values)):
        G[k, : len(g)], V[k, : len(v)] = g, v
    return G, V, torch.tensor(labels), torch.tensor(idx)


class CellEncoder(nn.Module):
    def __init__(self, n_genes, d, layers, n_classes):
        super().__init__()
        self.gene_emb = nn.Embedding(n_genes, d, padding_idx=PAD)
        self.value_emb = nn.Embedding(N_BINS + 1, d)
        layer = nn.TransformerEncoderLayer(d, d // 64, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.cls_head = nn.Linear(d, n_classes)

    def forward(self, genes, values):
        x = self.gene_emb(genes) + self.value_emb(values)
        h = self.norm(self.encoder(x, src_key_padding_mask=genes.eq(PAD)))
        return self.cls_head(h[:, 0])


@torch.no_grad()
def evaluate(model, loader, device, n_classes, n_items):
    model.eval()
    probs, ys, idxs = [], [], []
    for G, V, y, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(G.to(device), V.to(device))
        probs.append(F.softmax(logits.float(), -1).cpu().numpy())
        ys.append(y.numpy())
        idxs.append(idx.numpy())
    local = (np.concatenate(probs), np.concatenate(ys), np.concatenate(idxs))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    model.train()
    p = np.concatenate([g[0] for g in gathered])
    y = np.concatenate([g[1] for g in gathered])
    i = np.concatenate([g[2] for g in gathered])
    _, first = np.unique(i, return_index=True)  # DistributedSampler repeats a few cells to even out ranks
    p, y = p[first], y[first]
    assert len(y) == n_items
    present = np.unique(y)
    auroc = roc_auc_score(y, p[:, present] / p[:, present].sum(1, keepdims=True), multi_class="ovr",
                          labels=present) if len(present) > 2 else float("nan")
    return (p.argmax(1) == y).mean(), f1_score(y, p.argmax(1), average="macro"), auroc


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    with open(args.vocab) as fh:
        vocab = json.load(fh)
    adata = ad.read_h5ad(args.h5ad)
    adata = adata[:, adata.var["ensembl_id"].isin(vocab)].copy()
    X = adata.X if sp.issparse(adata.X) else sp.csr_matrix(adata.X)
    X = sp.diags(1e4 / np.maximum(np.asarray(X.sum(1)).ravel(), 1)) @ X
    X = X.log1p().tocsr().astype(np.float32)
    gene_ids = np.array([vocab[g] for g in adata.var["ensembl_id"]], dtype=np.int64)
    classes = sorted(adata.obs[args.label_key].astype(str).unique())
    cls_to_id = {c: k for k, c in enumerate(classes)}
    labels = adata.obs[args.label_key].astype(str).map(cls_to_id).to_numpy()

    tr_idx, va_idx = train_test_split(np.arange(adata.n_obs), test_size=0.1, stratify=labels, random_state=0)
    train_ds = CellDataset(X[tr_idx], gene_ids, labels[tr_idx], args.max_genes)
    valid_ds = CellDataset(X[va_idx], gene_ids, labels[va_idx], args.max_genes)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=tr_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, 128, sampler=DistributedSampler(valid_ds, shuffle=False),
                              collate_fn=collate, num_workers=2)

    model = CellEncoder(max(vocab.values()) + 1, args.d_model, args.layers, len(classes))
    if args.pretrained:
        state = torch.load(args.pretrained, map_location="cpu")["model"]
        state = {k: v for k, v in state.items() if not k.startswith("cls_head.")}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if rank == 0:
            print(f"loaded encoder: missing={missing} unexpected={len(unexpected)}", flush=True)
    model = DDP(model.to(device), device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * len(train_loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps + 1, pct_start=0.05)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "classes.json"), "w") as fh:
            json.dump(classes, fh)

    best_f1, gstep = -1.0, 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        for it, (G, V, y, _) in enumerate(train_loader):
            G, V, y = G.to(device, non_blocking=True), V.to(device, non_blocking=True), y.to(device)
            boundary = (it + 1) % args.accum == 0
            ctx = model.no_sync() if not boundary else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(G, V).float(), y, label_smoothing=0.1)
                (loss / args.accum).backward()
            if boundary:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                gstep += 1
                if writer is not None and gstep % 20 == 0:
                    writer.add_scalar("train/loss", loss.item(), gstep)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], gstep)

        acc, f1, auroc = evaluate(model, valid_loader, device, len(classes), len(valid_ds))
        if rank == 0:
            print(f"epoch {epoch}: acc {acc:.4f} macro-F1 {f1:.4f} AUROC {auroc:.4f}", flush=True)
            writer.add_scalar("valid/acc", acc, epoch)
            writer.add_scalar("valid/macro_f1", f1, epoch)
            writer.add_scalar("valid/auroc", auroc, epoch)
            if f1 > best_f1:
                best_f1 = f1
                torch.save({"model": model.module.state_dict(), "classes": classes, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
