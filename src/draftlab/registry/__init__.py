"""MLflow as the place drafts are compared and chosen: the exported draft as a registered model,
a sweep's best as an alias, and each run's data as MLflow datasets.

    drafts    the export folder as a logged model of its training run, a new version of one
              registered model per target with the figures users choose by (its tags and
              description); a sweep's best trial's version gets the alias `best-<study>`
    lineage   the prepared data and the hidden-state store as dataset inputs of the training
              run (context `training`) and of its evaluation (`evaluation`), with digests from
              the hashes the pipeline already keeps (the dataset fingerprint, the manifest's sha256)

Every write goes through an `MlflowTracker` (`call`): during an outage it is a spool record that
`draftlab tracking-import` replays with `replay`, and replaying twice registers nothing twice
(a version is found again by its folder's digest, an alias by its holder, an input by its
dataset's name and digest).

May import: the shared core (params, rundir, tracking, errors, util, console), `store.layout` and
`store.capture` (the dataset fingerprint).
Never a stage.
"""

from __future__ import annotations


def replay(client, rec) -> None:
    """One spooled registry or lineage record (rundir.SpooledInputs/Registration/Alias), uploaded."""
    if rec.kind == "inputs":
        from draftlab.registry.lineage import send_inputs

        send_inputs(client, rec.run_id, rec.datasets)
    elif rec.kind == "register":
        from draftlab.registry.drafts import replay_registration

        replay_registration(client, rec)
    else:
        from draftlab.registry.drafts import alias_best

        alias_best(client, name=rec.name, alias=rec.alias, run_id=rec.trial_run_id, metric=rec.metric,
                   direction=rec.direction, value=rec.value)
