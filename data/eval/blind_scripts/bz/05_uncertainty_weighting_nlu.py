"""NLU multi-task training (intent, sentiment, paraphrase) with homoscedastic
uncertainty weighting (Kendall et al., 2018).

total = sum_t exp(-s_t) * L_t + s_t, with s_t = log sigma_t^2 learned per task.

    torchrun --standalone --nproc_per_node=4 05_uncertainty_weighting_nlu.py \
        --data_dir data/nlu --save_dir ckpt/nlu_uw
"""
import argparse
import collections
import json
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger(__name__)
TASKS = ("intent", "sentiment", "paraphrase")


class JsonlPairs(Dataset):
    def __init__(self, path, tokenizer, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        enc = self.tok(r["text"], r.get("text_b"), truncation=True, max_length=self.max_len,
                       padding="max_length", return_tensors="pt")
        return enc["input_ids"][0], enc["attention_mask"][0], torch.tensor(r["label"])


class SharedBert(nn.Module):
    def __init__(self, name, n_labels):
        super().__init__()
        self.bert = AutoModel.from_pretrained(name)
        h = self.bert.config.hidden_size
        self.heads = nn.ModuleDict({t: nn.Linear(h, n_labels[t]) for t in TASKS})
        # s_t = log(sigma_t^2), trained jointly with the network
        self.log_vars = nn.Parameter(torch.zeros(len(TASKS)))

    def forward(self, task, ids, mask):
        pooled = self.bert(input_ids=ids, attention_mask=mask).pooler_output
        return self.heads[task](pooled), self.log_vars[TASKS.index(task)]


class MultiTaskLoss(nn.Module):
    """Cross entropy per task (class-weighted where the task is imbalanced) + uncertainty term."""

    def __init__(self, class_weights):
        super().__init__()
        for t, w in class_weights.items():
            self.register_buffer(f"cw_{t}", w)

    def forward(self, task, logits, labels, log_var):
        ce = F.cross_entropy(logits, labels, weight=getattr(self, f"cw_{task}"))
        return torch.exp(-log_var) * ce + log_var, ce.detach()


def inverse_freq_weights(labels, n):
    counts = np.bincount(labels, minlength=n).astype(np.float64) + 1.0
    w = counts.sum() / (n * counts)
    return torch.tensor(w / w.mean(), dtype=torch.float32)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--model", default="bert-base-cased")
    ap.add_argument("--max_len", type=int, default=96)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--log_var_lr", type=float, default=1e-2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


@torch.no_grad()
def run_eval(net, loaders, crit, device):
    net.eval()
    out = {}
    for t, dl in loaders.items():
        s = torch.zeros(3, device=device)  # correct, count, loss sum
        for ids, mask, y in dl:
            ids, mask, y = ids.to(device), mask.to(device), y.to(device)
            logits, lv = net(t, ids, mask)
            _, ce = crit(t, logits, y, lv)
            s += torch.stack([(logits.argmax(-1) == y).sum().float(),
                              torch.tensor(float(y.numel()), device=device), ce * y.numel()])
        dist.all_reduce(s)
        out[t] = {"acc": (s[0] / s[1]).item(), "loss": (s[2] / s[1]).item()}
    net.train()
    return out


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    train = {t: JsonlPairs(os.path.join(args.data_dir, t, "train.jsonl"), tok, args.max_len) for t in TASKS}
    dev = {t: JsonlPairs(os.path.join(args.data_dir, t, "dev.jsonl"), tok, args.max_len) for t in TASKS}
    with open(os.path.join(args.data_dir, "labels.json")) as f:
        n_labels = json.load(f)  # {"intent": 26, "sentiment": 3, "paraphrase": 2}

    samplers = {t: DistributedSampler(ds, shuffle=True, seed=args.seed) for t, ds in train.items()}
    train_dl = {t: DataLoader(ds, batch_size=args.bs, sampler=samplers[t], num_workers=4,
                              pin_memory=True, drop_last=True) for t, ds in train.items()}
    world = dist.get_world_size()
    dev_dl = {t: DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=128, num_workers=2)
              for t, ds in dev.items()}

    class_weights = {
        "intent": inverse_freq_weights([r["label"] for r in train["intent"].rows], n_labels["intent"]),
        "sentiment": torch.ones(n_labels["sentiment"]),
        "paraphrase": torch.ones(n_labels["paraphrase"]),
    }
    criterion = MultiTaskLoss(class_weights).to("cuda:0")

    net = SharedBert(args.model, n_labels).to(device)
    # one task per step -> the other heads get no gradient in that step
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    params = [
        {"params": [p for n, p in model.module.named_parameters() if n != "log_vars"], "lr": args.lr},
        {"params": [model.module.log_vars], "lr": args.log_var_lr, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, weight_decay=0.01)
    # round-robin over tasks until the smallest task is used up
    steps_per_epoch = min(len(dl) for dl in train_dl.values()) * len(TASKS)
    total = steps_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)

    os.makedirs(args.save_dir, exist_ok=True)
    history = []
    for epoch in range(args.epochs):
        for t in TASKS:
            samplers[t].set_epoch(epoch)
        iters = {t: iter(dl) for t, dl in train_dl.items()}
        meter = collections.defaultdict(list)
        model.train()
        for step in range(steps_per_epoch):
            task = TASKS[step % len(TASKS)]
            ids, mask, y = (x.to(device, non_blocking=True) for x in next(iters[task]))
            logits, lv = model(task, ids, mask)
            loss, ce = criterion(task, logits, y, lv)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            meter[task].append(ce.item())
            if step % 300 == 0:
                sig = torch.exp(0.5 * model.module.log_vars.detach()).tolist()
                log.info("epoch %d step %d %s sigma=%s", epoch, step,
                         {k: round(float(np.mean(v)), 4) for k, v in meter.items()},
                         [round(s, 3) for s in sig])

        res = run_eval(model.module, dev_dl, criterion, device)
        history.append(res)
        if rank == 0:
            log.info("epoch %d dev %s", epoch, res)
            torch.save({"model": model.module.state_dict(), "epoch": epoch,
                        "optimizer": optimizer.state_dict(), "n_labels": n_labels},
                       os.path.join(args.save_dir, f"epoch{epoch}.pt"))
            with open(os.path.join(args.save_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
