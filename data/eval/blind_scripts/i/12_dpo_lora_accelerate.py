"""DPO with LoRA, reference log-probs from the same weights with the adapter switched off.

accelerate launch --config_file configs/ddp_4gpu.yaml 12_dpo_lora_accelerate.py \
    --model_name ckpt/sft_llama3_8b --train_file data/prefs.jsonl --eval_file data/prefs_eval.jsonl
"""
import json
import math
import os
from dataclasses import dataclass, field
from typing import List

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, get_cosine_schedule_with_warmup


@dataclass
class Args:
    model_name: str
    train_file: str
    eval_file: str
    output_dir: str = "ckpt/dpo_lora"
    beta: float = 0.1
    lr: float = 5e-6
    per_device_batch_size: int = 2
    grad_accum: int = 8
    epochs: int = 1
    max_len: int = 2048
    lora_r: int = 64
    lora_alpha: int = 16
    lora_targets: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    eval_every: int = 250
    save_every: int = 500
    seed: int = 0


class Prefs(Dataset):
    def __init__(self, path, tok, max_len):
        self.rows = [json.loads(l) for l in open(path)]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def _pair(self, prompt, resp):
        p = self.tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        r = self.tok(resp, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = (p + r)[: self.max_len]
        return ids, ([-100] * len(p) + r)[: self.max_len]

    def __getitem__(self, i):
        x = self.rows[i]
        return self._pair(x["prompt"], x["chosen"]) + self._pair(x["prompt"], x["rejected"])


def make_batch(items, pad_id):
    seqs = [(c, cl) for c, cl, _, _ in items] + [(r, rl) for _, _, r, rl in items]
    n = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    lab = torch.full((len(seqs), n), -100, dtype=torch.long)
    for i, (s, l) in enumerate(seqs):
        ids[i, : len(s)], lab[i, : len(l)] = torch.tensor(s), torch.tensor(l)
    return {"input_ids": ids, "labels": lab, "attention_mask": ((lab != -100) | (ids != pad_id)).long()}


class BatchFn:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, items):
        return make_batch(items, self.pad_id)


def logps(model, batch):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = out.logits[:, :-1].float()
    tgt = batch["labels"][:, 1:]
    m = tgt != -100
    lp = logits.log_softmax(-1).gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lp * m).sum(-1)


def dpo(pol, ref, beta):
    h = pol.size(0) // 2
    margin = beta * ((pol[:h] - ref[:h]) - (pol[h:] - ref[h:]))
    return -F.logsigmoid(margin).mean(), margin.detach()


def main():
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="wandb")
    set_seed(args.seed)
    accelerator.init_trackers("dpo-lora", config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.model_name)
    tok.pad_token = tok.pad_token or tok.eos_token
    base = AutoModelForCausalLM.from_pretrained(args.model_name, torch_dtype=torch.bfloat16,
                                                attn_implementation="sdpa")
    base.config.use_cache = False
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                            target_modules=args.lora_targets, task_type="CAUSAL_LM"))

    fn = BatchFn(tok.pad_token_id)
    train_dl = DataLoader(Prefs(args.train_file, tok, args.max_len), batch_size=args.per_device_batch_size,
                          shuffle=True, collate_fn=fn, num_workers=2, drop_last=True)
    eval_dl = DataLoader(Prefs(args.eval_file, tok, args.max_len), batch_size=args.per_device_batch_size,
                         shuffle=False, collate_fn=fn, num_workers=2)
    opt = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=args.lr, weight_decay=0.0)

    # loaders are sharded by prepare(); count optimizer steps on the sharded length
    model, opt, train_dl, eval_dl = accelerator.prepare(model, opt, train_dl, eval_dl)
    total = math.ceil(len(train_dl) / args.grad_accum) * args.epochs
    # AcceleratedScheduler steps num_processes times per optimizer step (split_batches=False)
    n = accelerator.num_processes
    sched = accelerator.prepare(get_cosine_schedule_with_warmup(opt, int(0.1 * total) * n, total * n))
    raw = accelerator.unwrap_model(model)

    def ref_logps(batch):
        # plain module call under no_grad: no DDP forward, no reducer state touched
        with torch.no_grad(), raw.disable_adapter():
            return logps(raw, batch)

    def run_eval():
        model.eval()
        margins = []
        for batch in eval_dl:
            with torch.no_grad():
                pol = logps(model, batch)
            _, m = dpo(pol, ref_logps(batch), args.beta)
            margins.append(accelerator.gather_for_metrics(m))
        model.train()
        m = torch.cat(margins)
        return {"eval/reward_acc": (m > 0).float().mean().item(), "eval/margin": m.mean().item()}

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                ref = ref_logps(batch)
                pol = logps(model, batch)
                loss, margin = dpo(pol, ref, args.beta)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % 10 == 0:
                stats = accelerator.reduce(torch.stack([loss.detach(), (margin > 0).float().mean()]), "mean")
                accelerator.log({"train/loss": stats[0].item(), "train/reward_acc": stats[1].item(),
                                 "lr": sched.get_last_lr()[0]}, step=step)
            if step % args.eval_every == 0:
                metrics = run_eval()
                accelerator.log(metrics, step=step)
                accelerator.print(f"step {step}: {metrics}")
            if step % args.save_every == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"state_{step}"))

    accelerator.wait_for_everyone()
    raw.save_pretrained(os.path.join(args.output_dir, "final"), is_main_process=accelerator.is_main_process,
                        save_function=accelerator.save)
    if accelerator.is_main_process:
        tok.save_pretrained(os.path.join(args.output_dir, "final"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
