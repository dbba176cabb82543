"""MMLU helpers for the task YAMLs: the data loader and a first-n sampler that tolerates short pools."""

from lm_eval.api.samplers import FirstNSampler

from tunelab.evals.testsets.sources import load  # noqa: F401 - named by `custom_dataset: !function utils.load`


class FirstAvailable(FirstNSampler):
    """The first n dev questions, or all of them when fewer exist (the offline dev split of three
    subjects has 3 or 4); identical to lm-eval's first_n whenever the pool has n."""

    def sample(self, n, eval_doc=None, df=None, **kwargs):
        return super().sample(min(n, len(self.df)), eval_doc=eval_doc, df=df, **kwargs)
