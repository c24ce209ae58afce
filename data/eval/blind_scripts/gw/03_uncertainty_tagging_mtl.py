"""Joint NER / POS / chunking on three separate corpora with a shared XLM-R encoder.

Losses are combined with homoscedastic uncertainty weighting (Kendall et al. 2018):
    L = sum_t exp(-s_t) * L_t + s_t
where s_t = log sigma_t^2 is learned (kept inside the model so DDP syncs it).

    torchrun --nproc_per_node=4 train_tagging_mtl.py --config configs/tagging.yaml
"""
import argparse
import logging
import os
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from seqeval.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModel, AutoTokenizer, DataCollatorForTokenClassification, get_cosine_schedule_with_warmup

log = logging.getLogger(__name__)


@dataclass
class Config:
    encoder: str = "xlm-roberta-base"
    data_dir: str = "data/tagging"
    tasks: Dict[str, str] = field(default_factory=lambda: {"ner": "conll2003", "pos": "ud_ewt", "chunk": "conll2000"})
    max_len: int = 256
    batch_size: int = 16
    lr: float = 3e-5
    head_lr: float = 1e-3
    epochs: int = 10
    warmup: float = 0.1
    out_dir: str = "outputs/tagging_mtl"


def read_conll(path):
    sents, words, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                if words:
                    sents.append((words, tags))
                    words, tags = [], []
                continue
            cols = line.split("\t")
            words.append(cols[0])
            tags.append(cols[-1])
    if words:
        sents.append((words, tags))
    return sents


class TaggingDataset(Dataset):
    def __init__(self, path, tokenizer, label2id, max_len):
        self.sents = read_conll(path)
        self.tok = tokenizer
        self.label2id = label2id
        self.max_len = max_len

    def __len__(self):
        return len(self.sents)

    def __getitem__(self, i):
        words, tags = self.sents[i]
        enc = self.tok(words, is_split_into_words=True, truncation=True, max_length=self.max_len)
        labels, prev = [], None
        for wid in enc.word_ids():
            labels.append(-100 if wid is None or wid == prev else self.label2id[tags[wid]])
            prev = wid
        enc["labels"] = labels
        return dict(enc)


class MultiTaskTagger(nn.Module):
    def __init__(self, encoder_name, label_sizes):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_name, add_pooling_layer=False)
        h = self.encoder.config.hidden_size
        self.heads = nn.ModuleDict({t: nn.Linear(h, n) for t, n in label_sizes.items()})
        self.log_vars = nn.Parameter(torch.zeros(len(label_sizes)))
        self.task_index = {t: i for i, t in enumerate(label_sizes)}
        self.ce = nn.CrossEntropyLoss(ignore_index=-100)

    def forward(self, batches):
        total, per_task = 0.0, {}
        for t, b in batches.items():
            hid = self.encoder(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
            logits = self.heads[t](hid)
            loss = self.ce(logits.flatten(0, 1), b["labels"].flatten())
            s = self.log_vars[self.task_index[t]]
            total = total + torch.exp(-s) * loss + s
            per_task[t] = loss.detach()
        return total, per_task

    def predict(self, task, input_ids, attention_mask):
        hid = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.heads[task](hid).argmax(-1)


@torch.no_grad()
def evaluate(model, loaders, id2label, device):
    model.eval()
    scores = {}
    for t, loader in loaders.items():
        gold, pred = [], []
        for b in loader:
            b = {k: v.to(device) for k, v in b.items()}
            p = model.predict(t, b["input_ids"], b["attention_mask"])
            for pi, li in zip(p.tolist(), b["labels"].tolist()):
                g_seq = [id2label[t][l] for l in li if l != -100]
                p_seq = [id2label[t][x] for x, l in zip(pi, li) if l != -100]
                gold.append(g_seq)
                pred.append(p_seq)
        if t == "pos":
            flat = [(g == p) for gs, ps in zip(gold, pred) for g, p in zip(gs, ps)]
            scores[t] = sum(flat) / max(len(flat), 1)
        else:
            scores[t] = f1_score(gold, pred)
    model.train()
    return scores


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    cfg = Config()
    if args.config:
        with open(args.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    torch.manual_seed(1234)

    tokenizer = AutoTokenizer.from_pretrained(cfg.encoder)
    collate = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)

    label2id, id2label = {}, {}
    train_loaders, val_loaders, samplers = {}, {}, {}
    for t, corpus in cfg.tasks.items():
        with open(os.path.join(cfg.data_dir, corpus, "labels.txt")) as f:
            labels: List[str] = [l.strip() for l in f if l.strip()]
        label2id[t] = {l: i for i, l in enumerate(labels)}
        id2label[t] = {i: l for i, l in enumerate(labels)}
        tr = TaggingDataset(os.path.join(cfg.data_dir, corpus, "train.txt"), tokenizer, label2id[t], cfg.max_len)
        va = TaggingDataset(os.path.join(cfg.data_dir, corpus, "dev.txt"), tokenizer, label2id[t], cfg.max_len)
        samplers[t] = DistributedSampler(tr, shuffle=True, seed=1234)
        train_loaders[t] = DataLoader(tr, batch_size=cfg.batch_size, sampler=samplers[t],
                                      collate_fn=collate, num_workers=4, pin_memory=True)
        val_loaders[t] = DataLoader(va, batch_size=64, sampler=DistributedSampler(va, shuffle=False),
                                    collate_fn=collate, num_workers=2)

    model = MultiTaskTagger(cfg.encoder, {t: len(v) for t, v in label2id.items()}).to(device)
    model = DDP(model, device_ids=[local_rank])

    enc_params = [p for n, p in model.module.named_parameters() if n.startswith("encoder.")]
    other = [p for n, p in model.module.named_parameters() if not n.startswith("encoder.")]
    optimizer = torch.optim.AdamW([{"params": enc_params, "lr": cfg.lr},
                                   {"params": other, "lr": cfg.head_lr}], weight_decay=0.01)
    # an epoch is as long as the largest corpus; smaller ones are cycled
    steps_per_epoch = max(len(l) for l in train_loaders.values())
    total = steps_per_epoch * cfg.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup * total), total)

    os.makedirs(cfg.out_dir, exist_ok=True)
    best = 0.0
    for epoch in range(cfg.epochs):
        for t in samplers:
            samplers[t].set_epoch(epoch)
        iters = {t: iter(l) for t, l in train_loaders.items()}
        reshuffles = {t: 0 for t in train_loaders}
        model.train()
        for step in range(steps_per_epoch):
            batches = {}
            for t in train_loaders:
                try:
                    b = next(iters[t])
                except StopIteration:
                    reshuffles[t] += 1
                    samplers[t].set_epoch(epoch * 100 + reshuffles[t])
                    iters[t] = iter(train_loaders[t])
                    b = next(iters[t])
                batches[t] = {k: v.to(device, non_blocking=True) for k, v in b.items()}

            loss, per_task = model(batches)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()

            if step % 100 == 0:
                stats = torch.stack([loss.detach()] + [per_task[t] for t in train_loaders])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                sig = torch.exp(0.5 * model.module.log_vars.detach()).tolist()
                log.info("ep %d step %d/%d loss %.4f %s sigma %s", epoch, step, steps_per_epoch,
                         stats[0].item(),
                         " ".join(f"{t}={v:.3f}" for t, v in zip(train_loaders, stats[1:].tolist())),
                         ["%.3f" % s for s in sig])

        scores = evaluate(model.module, val_loaders, id2label, device)
        avg = sum(scores.values()) / len(scores)
        if rank == 0:
            log.info("epoch %d dev %s avg %.4f", epoch, scores, avg)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(cfg.out_dir, "last.pt"))
            if avg > best:
                best = avg
                model.module.encoder.save_pretrained(os.path.join(cfg.out_dir, "best_encoder"))
                torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
