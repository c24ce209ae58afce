"""Template-relevance model for one-step retrosynthesis (Segler & Waller style).

1. extract retro templates from atom-mapped reactions with rdchiral (rank 0, cached)
2. keep templates seen >= min_count times, label every reaction with its template id
3. train an MLP: product Morgan fingerprint -> template id, report top-k template accuracy

torchrun --nproc_per_node=4 16_template_relevance.py --data data/uspto_full_mapped --out runs/template_rel
"""
import argparse
import datetime
import json
import os
from collections import Counter

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from rdchiral.template_extractor import extract_from_reaction
from rdkit import Chem, DataStructs, RDLogger
from rdkit.Chem import AllChem
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")


def extract_templates(csv_path):
    df = pd.read_csv(csv_path)
    out = []
    for k, rxn in enumerate(df["reactants>reagents>production"]):
        reactants, _, product = rxn.split(">")
        try:
            tpl = extract_from_reaction({"_id": k, "reactants": reactants, "products": product})
        except Exception:
            continue
        if tpl and tpl.get("reaction_smarts"):
            out.append({"product": product, "template": tpl["reaction_smarts"]})
    return out


def prepare(data_dir, min_count, rank):
    cache = os.path.join(data_dir, f"templates_min{min_count}.json")
    if rank == 0 and not os.path.exists(cache):
        splits = {s: extract_templates(os.path.join(data_dir, f"raw_{s}.csv")) for s in ("train", "val", "test")}
        counts = Counter(r["template"] for r in splits["train"])
        templates = sorted(t for t, c in counts.items() if c >= min_count)
        tid = {t: i for i, t in enumerate(templates)}
        labelled = {s: [(r["product"], tid[r["template"]]) for r in rows if r["template"] in tid]
                    for s, rows in splits.items()}
        with open(cache + ".part", "w") as f:
            json.dump({"templates": templates, "data": labelled}, f)
        os.replace(cache + ".part", cache)
    dist.barrier()
    with open(cache) as f:
        return json.load(f)


def product_fp(smi, radius=2, nbits=2048):
    mol = Chem.MolFromSmiles(smi)
    for a in mol.GetAtoms():
        a.SetAtomMapNum(0)
    fp = AllChem.GetMorganFingerprintAsBitVect(mol, radius, nBits=nbits, useChirality=True)
    arr = np.zeros((nbits,), dtype=np.float32)
    DataStructs.ConvertToNumpyArray(fp, arr)
    return arr


class FPDataset(Dataset):
    def __init__(self, rows, nbits):
        self.rows, self.nbits = rows, nbits

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        smi, label = self.rows[i]
        return torch.from_numpy(product_fp(smi, nbits=self.nbits)), label


class TemplateRelevance(nn.Module):
    def __init__(self, nbits, n_templates, hidden=2048, depth=2, dropout=0.3):
        super().__init__()
        layers, d = [], nbits
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.ELU(), nn.Dropout(dropout)]
            d = hidden
        self.body = nn.Sequential(*layers)
        self.out = nn.Linear(d, n_templates)

    def forward(self, fp):
        return self.out(self.body(torch.log1p(fp)))


@torch.no_grad()
def topk_accuracy(model, loader, device, ks=(1, 5, 10, 50)):
    model.eval()
    acc = torch.zeros(len(ks) + 1, device=device)
    for fp, y in loader:
        fp, y = fp.to(device, non_blocking=True), y.to(device, non_blocking=True)
        top = model(fp).topk(max(ks), dim=1).indices
        hit = top.eq(y[:, None])
        for j, k in enumerate(ks):
            acc[j] += hit[:, :k].any(1).sum()
        acc[-1] += y.numel()
    dist.all_reduce(acc)
    model.train()
    return {f"top{k}": (acc[j] / acc[-1]).item() for j, k in enumerate(ks)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/template_rel")
    ap.add_argument("--min_count", type=int, default=3)
    ap.add_argument("--nbits", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--patience", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # first run: rank 0 spends a long time in rdchiral while the others sit in the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=4))
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)

    bundle = prepare(args.data, args.min_count, rank)
    n_templates = len(bundle["templates"])
    train_ds = FPDataset(bundle["data"]["train"], args.nbits)
    val_ds = FPDataset(bundle["data"]["val"], args.nbits)
    test_ds = FPDataset(bundle["data"]["test"], args.nbits)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=8, pin_memory=True,
                          drop_last=True)
    mk_eval = lambda ds: DataLoader(ds, 1024, sampler=DistributedSampler(ds, shuffle=False), num_workers=4)
    val_dl, test_dl = mk_eval(val_ds), mk_eval(test_ds)
    if rank == 0:
        print(f"{n_templates} templates, train/val/test = {len(train_ds)}/{len(val_ds)}/{len(test_ds)}", flush=True)

    model = DDP(TemplateRelevance(args.nbits, n_templates).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.3, patience=1)
    crit = nn.CrossEntropyLoss()

    best, bad = 0.0, 0
    best_path = os.path.join(args.out, "best.pt")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for fp, y in train_dl:
            fp, y = fp.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = crit(model(fp), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(run)

        val = topk_accuracy(model, val_dl, device)
        plateau.step(val["top1"])
        if rank == 0:
            print(f"epoch {epoch} train_loss {(run[0] / run[1]).item():.4f} "
                  + " ".join(f"{k}={v:.4f}" for k, v in val.items()), flush=True)

        torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                   os.path.join(args.out, "last.pt"))
        if val["top1"] > best:
            best, bad = val["top1"], 0
            torch.save(model.module.state_dict(), best_path)
        else:
            bad += 1
            if bad >= args.patience:
                break

    model.module.load_state_dict(torch.load(best_path, map_location=device))
    test = topk_accuracy(model, test_dl, device)
    if rank == 0:
        print("test " + " ".join(f"{k}={v:.4f}" for k, v in test.items()), flush=True)
        with open(os.path.join(args.out, "test_metrics.json"), "w") as f:
            json.dump(test, f, indent=2)
        with open(os.path.join(args.out, "templates.json"), "w") as f:
            json.dump(bundle["templates"], f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
