# CommonLit Readability Prize - electra-large attention-head regressor
# frequent in-epoch evaluation (the metric is very noisy), layerwise lr decay, 5 folds
#
#   torchrun --nproc_per_node=4 08_commonlit_electra_cache.py --cfg configs/electra_large.yaml
import argparse
import math
import os
import pickle
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


class Cfg:
    model = "google/electra-large-discriminator"
    data = "/data/commonlitreadabilityprize/train_folds.csv"
    cache_dir = "/data/cache"
    out = "./models/electra_large"
    max_len = 256
    folds = 5
    epochs = 3
    bs = 8
    lr = 2e-5
    head_lr = 1e-3
    llrd = 0.95
    warmup = 0.06
    eval_every = 20
    seed = 42


def get_cfg():
    p = argparse.ArgumentParser()
    p.add_argument("--cfg", default=None)
    a = p.parse_args()
    cfg = Cfg()
    if a.cfg:
        for k, v in (yaml.safe_load(open(a.cfg)) or {}).items():
            setattr(cfg, k, v)
    return cfg


def load_tokenized(cfg, df):
    os.makedirs(cfg.cache_dir, exist_ok=True)
    path = os.path.join(cfg.cache_dir, f"{cfg.model.replace('/', '_')}_{cfg.max_len}.pkl")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    tok = AutoTokenizer.from_pretrained(cfg.model)
    excerpts = df.excerpt.str.replace("\n", " ").tolist()
    enc = tok(excerpts, max_length=cfg.max_len, truncation=True, padding="max_length")
    data = {
        "input_ids": np.array(enc["input_ids"], dtype=np.int32),
        "attention_mask": np.array(enc["attention_mask"], dtype=np.int8),
    }
    with open(path, "wb") as f:
        pickle.dump(data, f)
    return data


class ExcerptDS(Dataset):
    def __init__(self, idx, enc, y):
        self.idx, self.enc, self.y = idx, enc, y

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        j = self.idx[i]
        return (torch.from_numpy(self.enc["input_ids"][j].astype(np.int64)),
                torch.from_numpy(self.enc["attention_mask"][j].astype(np.int64)),
                torch.tensor(self.y[j], dtype=torch.float32),
                torch.tensor(j))


class AttnHead(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.att = nn.Sequential(nn.Linear(h, 512), nn.Tanh(), nn.Linear(512, 1))
        self.out = nn.Linear(h, 1)

    def forward(self, hs, mask):
        w = self.att(hs).squeeze(-1).masked_fill(mask == 0, -1e4)
        w = torch.softmax(w, dim=1).unsqueeze(-1)
        return self.out((w * hs).sum(1)).squeeze(-1)


class Regressor(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.head = AttnHead(self.backbone.config.hidden_size)

    def forward(self, ids, mask):
        return self.head(self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state, mask)


def param_groups(model, cfg):
    layers = [model.backbone.embeddings] + list(model.backbone.encoder.layer)
    groups, lr = [], cfg.lr
    for layer in reversed(layers):
        groups.append({"params": list(layer.parameters()), "lr": lr})
        lr *= cfg.llrd
    groups.append({"params": list(model.head.parameters()), "lr": cfg.head_lr})
    return groups


@torch.no_grad()
def evaluate(model, loader, y, device):
    model.eval()
    idx, preds = [], []
    for ids, mask, _, j in loader:
        with torch.cuda.amp.autocast():
            preds.append(model(ids.to(device), mask.to(device)).float().cpu().numpy())
        idx.append(j.numpy())
    allp = [None] * dist.get_world_size()
    dist.all_gather_object(allp, (np.concatenate(idx), np.concatenate(preds)))
    out = {}
    for i, p in allp:
        out.update(zip(i.tolist(), p.tolist()))
    keys = np.array(sorted(out))
    pred = np.array([out[k] for k in keys])
    model.train()
    return keys, pred, math.sqrt(np.mean((y[keys] - pred) ** 2))


def run_fold(fold, cfg, df, enc, rank, local_rank):
    device = torch.device("cuda", local_rank)
    y = df.target.values.astype(np.float32)
    tr_idx, va_idx = np.where(df.kfold != fold)[0], np.where(df.kfold == fold)[0]
    tr_ds, va_ds = ExcerptDS(tr_idx, enc, y), ExcerptDS(va_idx, enc, y)
    tr_s = DistributedSampler(tr_ds, shuffle=True, seed=cfg.seed)
    va_s = DistributedSampler(va_ds, shuffle=False)
    tr_dl = DataLoader(tr_ds, batch_size=cfg.bs, sampler=tr_s, num_workers=2, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, batch_size=cfg.bs * 4, sampler=va_s, num_workers=2)

    torch.manual_seed(cfg.seed)
    model = Regressor(cfg.model).to(device)
    opt = torch.optim.AdamW(param_groups(model, cfg), weight_decay=0.01)
    model = DDP(model, device_ids=[local_rank])
    total = len(tr_dl) * cfg.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(cfg.warmup * total), total)
    scaler = torch.cuda.amp.GradScaler()
    mse = nn.MSELoss()

    best, oof, step = np.inf, None, 0
    for ep in range(cfg.epochs):
        tr_s.set_epoch(ep)
        model.train()
        for ids, mask, target, _ in tr_dl:
            with torch.cuda.amp.autocast():
                pred = model(ids.to(device), mask.to(device))
            loss = torch.sqrt(mse(pred.float(), target.to(device)))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % cfg.eval_every == 0 or step == total:
                keys, p, rmse = evaluate(model.module, va_dl, y, device)
                if rmse < best:
                    best = rmse
                    oof = pd.DataFrame({"id": df.id.values[keys], "target": y[keys], "pred": p})
                    if rank == 0:
                        torch.save(model.module.state_dict(), os.path.join(cfg.out, f"fold{fold}.bin"))
                if rank == 0:
                    print(f"fold {fold} ep {ep} step {step}/{total} rmse {rmse:.4f} best {best:.4f}", flush=True)
    dist.barrier()
    return best, oof


def main():
    cfg = get_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    os.makedirs(cfg.out, exist_ok=True)

    df = pd.read_csv(cfg.data)
    t0 = time.time()
    enc = load_tokenized(cfg, df)
    if rank == 0:
        print(f"tokenized {len(df)} excerpts in {time.time() - t0:.1f}s")

    scores, oofs = [], []
    for fold in range(cfg.folds):
        s, oof = run_fold(fold, cfg, df, enc, rank, local_rank)
        scores.append(s)
        oofs.append(oof)
    if rank == 0:
        oof = pd.concat(oofs)
        oof.to_csv(os.path.join(cfg.out, "oof.csv"), index=False)
        cv = math.sqrt(np.mean((oof.target - oof.pred) ** 2))
        print(f"fold rmse {np.round(scores, 4)} | CV {cv:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
