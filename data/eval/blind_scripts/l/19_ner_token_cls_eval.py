# NER fine-tuning (xlm-roberta-large) on a CoNLL-format corpus, DDP + bf16,
# entity-level F1 on the dev set after every epoch, best checkpoint kept.
#
#   torchrun --standalone --nproc_per_node=8 19_ner_token_cls_eval.py \
#       --dataset eriktks/conll2003 --model FacebookAI/xlm-roberta-large --epochs 10
import argparse
import os
import time

import torch
import torch.distributed as dist
import wandb
from datasets import load_dataset
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForTokenClassification, AutoTokenizer,
                          DataCollatorForTokenClassification, get_linear_schedule_with_warmup)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="eriktks/conll2003")
    ap.add_argument("--model", default="FacebookAI/xlm-roberta-large")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--out", default="ckpt/ner_xlmr")
    ap.add_argument("--wandb_project", default="ner")
    return ap.parse_args()


def align_labels(batch, tok):
    enc = tok(batch["tokens"], is_split_into_words=True, truncation=True, max_length=256)
    all_labels = []
    for i, tags in enumerate(batch["ner_tags"]):
        word_ids = enc.word_ids(batch_index=i)
        prev, lab = None, []
        for w in word_ids:
            if w is None or w == prev:
                lab.append(-100)
            else:
                lab.append(tags[w])
            prev = w
        all_labels.append(lab)
    enc["labels"] = all_labels
    return enc


@torch.no_grad()
def evaluate(model, loader, id2label, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        preds = logits.argmax(-1).cpu().tolist()
        labels = batch["labels"].cpu().tolist()
        for p_row, l_row in zip(preds, labels):
            t, p = [], []
            for pi, li in zip(p_row, l_row):
                if li == -100:
                    continue
                t.append(id2label[li])
                p.append(id2label[pi])
            y_true.append(t)
            y_pred.append(p)
    model.train()
    return f1_score(y_true, y_pred), classification_report(y_true, y_pred, digits=4)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        wandb.init(project=args.wandb_project, config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.model)
    if rank != 0:
        dist.barrier()
    ds = load_dataset(args.dataset)
    label_names = ds["train"].features["ner_tags"].feature.names
    ds = ds.map(align_labels, fn_kwargs={"tok": tok}, batched=True,
                remove_columns=ds["train"].column_names)
    if rank == 0:
        dist.barrier()
    id2label = dict(enumerate(label_names))

    collator = DataCollatorForTokenClassification(tok, pad_to_multiple_of=8)
    tr_sampler = DistributedSampler(ds["train"], shuffle=True, seed=13)
    dev_sampler = DistributedSampler(ds["validation"], shuffle=False)
    train_dl = DataLoader(ds["train"], batch_size=args.bs, sampler=tr_sampler, collate_fn=collator,
                          num_workers=4, pin_memory=True)
    dev_dl = DataLoader(ds["validation"], batch_size=64, sampler=dev_sampler, collate_fn=collator,
                        num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(label_names), id2label=id2label,
        label2id={v: k for k, v in id2label.items()}).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(optim, int(0.1 * total), total)

    best_f1 = -1.0
    step = 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "lr": sched.get_last_lr()[0]}, step=step)

        f1, report = evaluate(model.module, dev_dl, id2label, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) dev F1 {f1:.4f}\n{report}", flush=True)
            wandb.log({"dev/f1": f1, "epoch": epoch}, step=step)
            if f1 > best_f1:
                best_f1 = f1
                model.module.save_pretrained(args.out)
                tok.save_pretrained(args.out)
                wandb.run.summary["best_dev_f1"] = best_f1
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
