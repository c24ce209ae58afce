"""Clinical NER fine-tuning (token classification), Hydra + MLflow.

    torchrun --nproc-per-node=8 --max-restarts=1 train_ner.py data=i2b2_2014 model=biolinkbert_large
"""
import logging
import os
import time

import hydra
import mlflow
import torch
import torch.distributed as dist
from datasets import load_from_disk
from omegaconf import DictConfig, OmegaConf
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    get_linear_schedule_with_warmup,
)

log = logging.getLogger(__name__)


def tokenize_and_align(batch, tokenizer, max_len, label_all_subwords=False):
    enc = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
    all_labels = []
    for i, tags in enumerate(batch["ner_tags"]):
        word_ids = enc.word_ids(batch_index=i)
        prev, labels = None, []
        for w in word_ids:
            if w is None:
                labels.append(-100)
            elif w != prev or label_all_subwords:
                labels.append(tags[w])
            else:
                labels.append(-100)
            prev = w
        all_labels.append(labels)
    enc["labels"] = all_labels
    return enc


@torch.no_grad()
def evaluate(model, loader, device, id2label):
    model.eval()
    preds, golds, loss_sum, n = [], [], torch.zeros(1, device=device), torch.zeros(1, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        loss_sum += out.loss * batch["input_ids"].size(0)
        n += batch["input_ids"].size(0)
        keep = batch["labels"] != -100
        preds.append(out.logits.argmax(-1)[keep])
        golds.append(batch["labels"][keep])
    preds, golds = torch.cat(preds), torch.cat(golds)

    world = dist.get_world_size()
    all_preds = [torch.empty_like(preds) for _ in range(world)]
    all_golds = [torch.empty_like(golds) for _ in range(world)]
    dist.all_gather(all_preds, preds)
    dist.all_gather(all_golds, golds)
    dist.all_reduce(loss_sum)
    dist.all_reduce(n)
    model.train()

    # seqeval wants tag sequences; entity spans never cross a rank boundary, so one flat sequence per rank
    p_tags = [[id2label[int(i)] for i in p] for p in all_preds]
    g_tags = [[id2label[int(i)] for i in g] for g in all_golds]
    return (loss_sum / n).item(), f1_score(g_tags, p_tags), classification_report(g_tags, p_tags, digits=4)


@hydra.main(config_path="conf", config_name="ner", version_base="1.3")
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    raw = load_from_disk(cfg.data.path)  # pre-built DatasetDict on the shared volume
    label_list = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_list))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name)

    cols = raw["train"].column_names
    if rank == 0:
        tokenized = raw.map(tokenize_and_align, batched=True, remove_columns=cols,
                            fn_kwargs={"tokenizer": tokenizer, "max_len": cfg.data.max_len})
    dist.barrier()
    if rank != 0:
        tokenized = raw.map(tokenize_and_align, batched=True, remove_columns=cols,
                            fn_kwargs={"tokenizer": tokenizer, "max_len": cfg.data.max_len})
    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)

    train_sampler = DistributedSampler(tokenized["train"], shuffle=True, seed=cfg.seed)
    val_sampler = DistributedSampler(tokenized["validation"], shuffle=False, drop_last=True)
    train_loader = DataLoader(tokenized["train"], batch_size=cfg.train.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=2, pin_memory=True)
    val_loader = DataLoader(tokenized["validation"], batch_size=cfg.train.eval_batch_size,
                            sampler=val_sampler, collate_fn=collator, num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        cfg.model.name, num_labels=len(label_list), id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
    ).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.01)
    total = len(train_loader) * cfg.train.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)

    out_dir = cfg.output_dir
    ckpt_file = os.path.join(out_dir, "checkpoint.pt")
    start_epoch, best_f1, run_id = 0, 0.0, None
    if os.path.exists(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_f1, run_id = ckpt["epoch"] + 1, ckpt["best_f1"], ckpt["mlflow_run_id"]

    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        mlflow.set_experiment(cfg.mlflow.experiment)
        run_id = mlflow.start_run(run_id=run_id, run_name=cfg.run_name).info.run_id
        mlflow.log_params(OmegaConf.to_container(cfg.train))

    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    mlflow.log_metric("train_loss", l.item(), step=step)

        val_loss, val_f1, report = evaluate(model, val_loader, device, id2label)
        if rank == 0:
            mlflow.log_metrics({"val_loss": val_loss, "val_f1": val_f1,
                                "epoch_seconds": time.time() - tic}, step=step)
            log.info("epoch %d val_f1 %.4f\n%s", epoch, val_f1, report)
            if val_f1 > best_f1:
                best_f1 = val_f1
                model.module.save_pretrained(os.path.join(out_dir, "best"))
                tokenizer.save_pretrained(os.path.join(out_dir, "best"))
                mlflow.log_text(report, f"reports/epoch_{epoch}.txt")
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_f1": best_f1,
                        "mlflow_run_id": run_id}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
