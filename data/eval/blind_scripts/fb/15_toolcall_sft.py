"""Function-calling SFT: teaches the model to emit JSON tool calls. DeepSpeed ZeRO-2, bf16.

deepspeed --num_gpus 8 toolcall_sft.py --model NousResearch/Meta-Llama-3-8B-Instruct \
    --data data/toolcall/train.jsonl --eval data/toolcall/dev.jsonl --out runs/toolcall-8b
"""
import argparse
import json
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

SYSTEM = "You are a helpful assistant with access to the following functions:\n{tools}\n" \
         "To call a function respond with a JSON object {{\"name\": ..., \"arguments\": {{...}}}}."


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--gas", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max_len", type=int, default=3072)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class ToolCallData(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            self.items = [json.loads(l) for l in f]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        msgs = [{"role": "system", "content": SYSTEM.format(tools=json.dumps(it["tools"], indent=1))},
                {"role": "user", "content": it["query"]}]
        prompt_ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True)
        target = json.dumps(it["call"], ensure_ascii=False) + self.tok.eos_token
        target_ids = self.tok(target, add_special_tokens=False)["input_ids"]
        ids = (prompt_ids + target_ids)[: self.max_len]
        labels = ([-100] * len(prompt_ids) + target_ids)[: self.max_len]
        return ids, labels


def collate(pad_id):
    def f(batch):
        L = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        lab = torch.full((len(batch), L), -100, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            lab[i, : len(y)] = torch.tensor(y)
            att[i, : len(x)] = 1
        return ids, lab, att
    return f


@torch.no_grad()
def token_accuracy(engine, loader):
    """teacher-forced accuracy on the JSON call tokens"""
    engine.eval()
    correct = torch.zeros((), device=engine.device, dtype=torch.long)
    total = torch.zeros((), device=engine.device, dtype=torch.long)
    exact = torch.zeros((), device=engine.device, dtype=torch.long)
    n_seq = torch.zeros((), device=engine.device, dtype=torch.long)
    for ids, lab, att in loader:
        ids, lab, att = ids.to(engine.device), lab.to(engine.device), att.to(engine.device)
        logits = engine(input_ids=ids, attention_mask=att).logits[:, :-1]
        tgt = lab[:, 1:]
        mask = tgt != -100
        hit = (logits.argmax(-1) == tgt) & mask
        correct += hit.sum()
        total += mask.sum()
        exact += (hit.sum(-1) == mask.sum(-1)).sum()
        n_seq += ids.size(0)
    for t in (correct, total, exact, n_seq):
        dist.all_reduce(t)
    engine.train()
    return correct.item() / max(total.item(), 1), exact.item() / max(n_seq.item(), 1)


def main():
    args = parse()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = "<|end_of_text|>"

    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        torch_dtype=torch.bfloat16,
        device_map="auto",
        low_cpu_mem_usage=True,
        attn_implementation="sdpa",
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    train_ds = ToolCallData(args.data, tok, args.max_len)
    eval_ds = ToolCallData(args.eval, tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=5)
    train_dl = DataLoader(train_ds, batch_size=args.mbs, sampler=sampler, collate_fn=collate(tok.pad_token_id),
                          num_workers=4)
    eval_dl = DataLoader(eval_ds, batch_size=args.mbs, sampler=DistributedSampler(eval_ds, shuffle=False),
                         collate_fn=collate(tok.pad_token_id))

    total_steps = args.epochs * len(train_dl) // args.gas
    cfg = {
        "train_micro_batch_size_per_gpu": args.mbs,
        "gradient_accumulation_steps": args.gas,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 2e8},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": total_steps, "warmup_num_steps": int(0.05 * total_steps)}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    best = 0.0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for ids, lab, att in train_dl:
            loss = engine(input_ids=ids.to(engine.device), attention_mask=att.to(engine.device),
                          labels=lab.to(engine.device)).loss
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary() and rank == 0 and engine.global_steps % 20 == 0:
                print(f"[{time.time() - t0:.0f}s] ep {epoch} step {engine.global_steps}/{total_steps} "
                      f"loss {loss.item():.4f}", flush=True)

        tok_acc, exact = token_accuracy(engine, eval_dl)
        if rank == 0:
            print(f"== epoch {epoch}: token_acc {tok_acc:.4f} exact_match {exact:.4f}", flush=True)
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"exact": exact})
        if exact > best:
            best = exact
            engine.save_16bit_model(os.path.join(args.out, "best"))
            if rank == 0:
                tok.save_pretrained(os.path.join(args.out, "best"))
                engine.module.config.save_pretrained(os.path.join(args.out, "best"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
