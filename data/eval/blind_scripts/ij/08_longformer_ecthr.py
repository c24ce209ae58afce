"""ECtHR task B (allegation prediction) with a Legal-Longformer encoder and
attention-masked mean pooling. Facts paragraphs are joined with </s> and the
whole case is fed as one 4096-token sequence.

torchrun --nproc_per_node=8 08_longformer_ecthr.py --epochs 20 --out runs/ecthr_b_lf
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger("ecthr_b")


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--encoder", default="lexlms/legal-longformer-base")
    ap.add_argument("--max_len", type=int, default=4096)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--out", default="runs/ecthr_b_lf")
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


class CaseCollator:
    def __init__(self, tokenizer, max_len, num_labels):
        self.tok = tokenizer
        self.max_len = max_len
        self.num_labels = num_labels

    def __call__(self, examples):
        texts = [f" {self.tok.sep_token} ".join(ex["text"]) for ex in examples]
        enc = self.tok(texts, truncation=True, max_length=self.max_len, padding="longest",
                       pad_to_multiple_of=512, return_tensors="pt")
        global_attention_mask = torch.zeros_like(enc["input_ids"])
        global_attention_mask[:, 0] = 1
        labels = torch.zeros(len(examples), self.num_labels)
        for i, ex in enumerate(examples):
            labels[i, ex["labels"]] = 1.0
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "global_attention_mask": global_attention_mask, "labels": labels}


class LongformerMultiLabel(nn.Module):
    def __init__(self, name, num_labels):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)
        hidden = self.encoder.config.hidden_size
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, input_ids, attention_mask, global_attention_mask):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                           global_attention_mask=global_attention_mask)
        h = out.last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.classifier(self.dropout(pooled))


@torch.no_grad()
def run_eval(model, loader, device, n_examples, world_size):
    model.eval()
    logits_l, labels_l = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batch["input_ids"], batch["attention_mask"], batch["global_attention_mask"])
        logits_l.append(logits.float())
        labels_l.append(batch["labels"])
    logits = torch.cat(logits_l)
    labels = torch.cat(labels_l)
    gl = [torch.zeros_like(logits) for _ in range(world_size)]
    gy = [torch.zeros_like(labels) for _ in range(world_size)]
    dist.all_gather(gl, logits)
    dist.all_gather(gy, labels)
    # interleave back to dataset order, then drop the sampler's padding
    logits = torch.stack(gl, 1).flatten(0, 1)[:n_examples]
    labels = torch.stack(gy, 1).flatten(0, 1)[:n_examples]
    pred = (logits.sigmoid() > 0.5).cpu().numpy()
    gold = labels.cpu().numpy().astype(int)
    model.train()
    return {"micro_f1": f1_score(gold, pred, average="micro", zero_division=0),
            "macro_f1": f1_score(gold, pred, average="macro", zero_division=0)}


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    data = load_dataset("lex_glue", "ecthr_b")
    num_labels = data["train"].features["labels"].feature.num_classes
    tokenizer = AutoTokenizer.from_pretrained(args.encoder)
    collate = CaseCollator(tokenizer, args.max_len, num_labels)

    train_sampler = DistributedSampler(data["train"], shuffle=True, seed=args.seed)
    train_loader = DataLoader(data["train"], batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(data["validation"], batch_size=args.batch_size,
                            sampler=DistributedSampler(data["validation"], shuffle=False),
                            collate_fn=collate, num_workers=4)

    model = LongformerMultiLabel(args.encoder, num_labels).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)
    criterion = nn.BCEWithLogitsLoss()

    best = 0.0
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch["input_ids"], batch["attention_mask"], batch["global_attention_mask"])
            loss = criterion(logits.float(), batch["labels"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if step % 50 == 0:
                log.info("epoch %d step %d loss %.4f elapsed %.0fs", epoch, step, loss.item(), time.time() - start)

        metrics = run_eval(model.module, val_loader, device, len(data["validation"]), world_size)
        log.info("epoch %d validation %s", epoch, metrics)
        if rank == 0 and metrics["micro_f1"] > best:
            best = metrics["micro_f1"]
            torch.save({"state_dict": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                       os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
