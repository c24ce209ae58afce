"""Token classification (CoNLL-2003 NER) with DeepSpeed ZeRO-3.

Entity-level F1 (seqeval) on the validation split every --eval-every steps; the
best weights are exported as a plain HF checkpoint; early stopping on F1.

    deepspeed --num_gpus=8 06_ner_deberta_zero3.py --model microsoft/deberta-v3-large
"""
import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_dataset
from seqeval.metrics import f1_score, precision_score, recall_score
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="microsoft/deberta-v3-large")
    parser.add_argument("--output_dir", default="out/ner_deberta")
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=300)
    parser.add_argument("--patience", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def ds_config(args, total_steps):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01, "betas": [0.9, 0.999]}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                       "warmup_num_steps": int(0.06 * total_steps), "total_num_steps": total_steps},
        },
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 100,
    }


def align_labels(examples, tokenizer):
    enc = tokenizer(examples["tokens"], is_split_into_words=True, truncation=True, max_length=256)
    all_labels = []
    for i, tags in enumerate(examples["ner_tags"]):
        word_ids = enc.word_ids(batch_index=i)
        prev, labels = None, []
        for w in word_ids:
            if w is None or w == prev:
                labels.append(-100)
            else:
                labels.append(tags[w])
            prev = w
        all_labels.append(labels)
    enc["labels"] = all_labels
    return enc


def evaluate(engine, loader, id2label, device, n_total):
    engine.eval()
    true_seqs, pred_seqs = [], []
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = engine(**batch).logits
            preds = logits.argmax(-1).cpu().tolist()
            labels = batch["labels"].cpu().tolist()
            for p_row, l_row in zip(preds, labels):
                true_seqs.append([id2label[l] for l in l_row if l != -100])
                pred_seqs.append([id2label[p] for p, l in zip(p_row, l_row) if l != -100])
    world = dist.get_world_size()
    gathered = [None] * world
    dist.all_gather_object(gathered, (true_seqs, pred_seqs))
    # rank r holds sentences r, r + world, ...; interleave back and cut the padding
    y_true = [gathered[r][0][k] for k in range(len(true_seqs)) for r in range(world)][:n_total]
    y_pred = [gathered[r][1][k] for k in range(len(pred_seqs)) for r in range(world)][:n_total]
    engine.train()
    return {"f1": f1_score(y_true, y_pred), "precision": precision_score(y_true, y_pred),
            "recall": recall_score(y_true, y_pred)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()

    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def prepare():
        raw = load_dataset("conll2003")
        enc = raw.map(align_labels, batched=True, fn_kwargs={"tokenizer": tokenizer},
                      remove_columns=raw["train"].column_names)
        return raw["train"].features["ner_tags"].feature.names, enc

    if rank == 0:
        prepare()
    dist.barrier()
    label_list, tokenized = prepare()
    id2label = dict(enumerate(label_list))

    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(tokenized["train"], shuffle=True, seed=42)
    train_loader = DataLoader(tokenized["train"], batch_size=args.micro_batch, sampler=train_sampler,
                              collate_fn=collator, num_workers=2, drop_last=True)
    # ZeRO-3 forwards are collective: every rank must run the same number of eval batches,
    # so pad the shards and drop the duplicates after gathering
    val_sampler = DistributedSampler(tokenized["validation"], shuffle=False)
    val_set = tokenized["validation"].select(list(val_sampler))
    val_loader = DataLoader(val_set, batch_size=32, collate_fn=collator)
    n_val = len(tokenized["validation"])

    steps_per_epoch = len(train_loader) // args.grad_accum
    with deepspeed.zero.Init(config_dict_or_path=ds_config(args, steps_per_epoch * args.epochs)):
        model = AutoModelForTokenClassification.from_pretrained(
            args.model, num_labels=len(label_list), id2label=id2label,
            label2id={v: k for k, v in id2label.items()})
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=model.parameters(),
                                           config=ds_config(args, steps_per_epoch * args.epochs))

    best_f1, bad, micro_step = -1.0, 0, 0
    best_dir = os.path.join(args.output_dir, "best")
    done = False
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            micro_step += 1
            if not engine.is_gradient_accumulation_boundary():
                continue
            step = engine.global_steps
            if step % args.eval_every != 0:
                continue

            scores = evaluate(engine, val_loader, id2label, device, n_val)
            if rank == 0:
                print(f"[eval] epoch {epoch} step {step}: {json.dumps(scores)}", flush=True)
            if scores["f1"] > best_f1:
                best_f1, bad = scores["f1"], 0
                if rank == 0:
                    os.makedirs(best_dir, exist_ok=True)
                    torch.save(engine.module.state_dict(), os.path.join(best_dir, "pytorch_model.bin"))
                    engine.module.config.save_pretrained(best_dir)
                    tokenizer.save_pretrained(best_dir)
                    with open(os.path.join(best_dir, "val_scores.json"), "w") as f:
                        json.dump({"step": step, **scores}, f)
                dist.barrier()
            else:
                bad += 1
                if bad >= args.patience:
                    done = True
                    break
        if done:
            break

    if rank == 0:
        print(f"training finished, best val F1 {best_f1:.4f} -> {best_dir}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
