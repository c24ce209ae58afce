#!/usr/bin/env python
"""
SQuAD fine-tuning for preemptible nodes: checkpoints every --save_steps and resumes mid-epoch.

    torchrun --nproc_per_node=4 11_qa_resumable_bert.py --output_dir /mnt/shared/qa/bert-large-cased
    (re-run the same command after a preemption; it picks up <output_dir>/latest.pt)
"""
import argparse
import collections
import itertools
import logging
import os

import evaluate
import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

log = logging.getLogger("qa")


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert-large-cased")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_seq_len", type=int, default=384)
    p.add_argument("--doc_stride", type=int, default=128)
    p.add_argument("--bsz", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup", type=float, default=0.1)
    p.add_argument("--save_steps", type=int, default=1000)
    p.add_argument("--n_best", type=int, default=20)
    p.add_argument("--max_answer_len", type=int, default=30)
    return p.parse_args()


def featurize_train(ex, tok, a):
    enc = tok([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second",
              max_length=a.max_seq_len, stride=a.doc_stride, return_overflowing_tokens=True,
              return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    sp, ep = [], []
    for i, offs in enumerate(enc.pop("offset_mapping")):
        seq = enc.sequence_ids(i)
        ans = ex["answers"][smap[i]]
        sc = ans["answer_start"][0]
        ec = sc + len(ans["text"][0])
        ctx = [k for k, s in enumerate(seq) if s == 1]
        if offs[ctx[0]][0] > sc or offs[ctx[-1]][1] < ec:
            sp.append(0)
            ep.append(0)
        else:
            sp.append(next(k for k in ctx if offs[k][1] > sc))
            ep.append(next(k for k in reversed(ctx) if offs[k][0] < ec))
    enc["start_positions"], enc["end_positions"] = sp, ep
    return enc


def featurize_eval(ex, tok, a):
    enc = tok([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second",
              max_length=a.max_seq_len, stride=a.doc_stride, return_overflowing_tokens=True,
              return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    enc["example_id"] = [ex["id"][j] for j in smap]
    enc["offset_mapping"] = [[o if s == 1 else None for o, s in zip(offs, enc.sequence_ids(i))]
                             for i, offs in enumerate(enc["offset_mapping"])]
    return enc


def best_spans(examples, feats, logits, a):
    groups = collections.defaultdict(list)
    for i, eid in enumerate(feats["example_id"]):
        groups[eid].append(i)
    preds = []
    for ex in examples:
        cands = []
        for fi in groups[ex["id"]]:
            st, en = logits[fi]
            offs = feats[fi]["offset_mapping"]
            top_s = np.argsort(st)[::-1][: a.n_best]
            top_e = np.argsort(en)[::-1][: a.n_best]
            for s, e in itertools.product(top_s, top_e):
                if s >= len(offs) or e >= len(offs) or offs[s] is None or offs[e] is None:
                    continue
                if e < s or e - s + 1 > a.max_answer_len:
                    continue
                cands.append((st[s] + en[e], ex["context"][offs[s][0]:offs[e][1]]))
        preds.append({"id": ex["id"], "prediction_text": max(cands)[1] if cands else ""})
    return preds


@torch.no_grad()
def dev_logits(model, dl, device):
    model.eval()
    part = []
    for b in dl:
        fidx = b.pop("fidx").tolist()
        n = b["attention_mask"].sum(1).tolist()
        b = {k: v.to(device) for k, v in b.items()}
        o = model(**b)
        s, e = o.start_logits.float().cpu().numpy(), o.end_logits.float().cpu().numpy()
        part += [(i, s[j, :n[j]], e[j, :n[j]]) for j, i in enumerate(fidx)]
    allp = [None] * dist.get_world_size()
    dist.all_gather_object(allp, part)
    model.train()
    return {i: (s, e) for p in allp for i, s, e in p}


def save_state(path, model, opt, sched, scaler, epoch, step_in_epoch, global_step):
    tmp = path + ".tmp"
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
        "global_step": global_step,
    }, tmp)
    os.replace(tmp, path)


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(1)

    tok = AutoTokenizer.from_pretrained(a.model)
    raw = load_dataset("squad")
    if rank != 0:
        dist.barrier()
    train = raw["train"].map(featurize_train, batched=True, fn_kwargs={"tok": tok, "a": a},
                             remove_columns=raw["train"].column_names, num_proc=8)
    dev_feats = raw["validation"].map(featurize_eval, batched=True, fn_kwargs={"tok": tok, "a": a},
                                      remove_columns=raw["validation"].column_names, num_proc=8)
    if rank == 0:
        dist.barrier()
    dev = dev_feats.remove_columns(["example_id", "offset_mapping"])
    dev = dev.add_column("fidx", list(range(len(dev))))

    collate = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    sampler = DistributedSampler(train, shuffle=True, seed=1)
    train_dl = DataLoader(train, batch_size=a.bsz, sampler=sampler, collate_fn=collate, num_workers=4,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev, batch_size=64, sampler=DistributedSampler(dev, shuffle=False), collate_fn=collate)

    model = AutoModelForQuestionAnswering.from_pretrained(a.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    total = a.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(a.warmup * total), total)
    scaler = torch.cuda.amp.GradScaler()

    latest = os.path.join(a.output_dir, "latest.pt")
    start_epoch, skip_steps, global_step = 0, 0, 0
    if os.path.exists(latest):
        state = torch.load(latest)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, skip_steps, global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        log.info("resuming from %s: epoch %d, step %d", latest, start_epoch, skip_steps)
        del state

    squad = evaluate.load("squad")
    os.makedirs(a.output_dir, exist_ok=True)
    for epoch in range(start_epoch, a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            if epoch == start_epoch and step < skip_steps:
                continue  # same sampler order on resume, fast-forward the batches already seen
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            global_step += 1
            if global_step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step + 1, len(train_dl), loss.item())
            if global_step % a.save_steps == 0:
                if rank == 0:
                    save_state(latest, model, opt, sched, scaler, epoch, step + 1, global_step)
                dist.barrier()

        logits = dev_logits(model, dev_dl, device)
        if rank == 0:
            preds = best_spans(raw["validation"], dev_feats, logits, a)
            refs = [{"id": ex["id"], "answers": ex["answers"]} for ex in raw["validation"]]
            res = squad.compute(predictions=preds, references=refs)
            log.info("epoch %d dev EM %.2f F1 %.2f", epoch, res["exact_match"], res["f1"])
            save_state(latest, model, opt, sched, scaler, epoch + 1, 0, global_step)
            model.module.save_pretrained(os.path.join(a.output_dir, f"epoch{epoch}"))
            tok.save_pretrained(os.path.join(a.output_dir, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
