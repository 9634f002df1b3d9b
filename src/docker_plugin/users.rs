//! How a Docker Mount ID is recorded as a user of a volume in the provider.
//!
//! A Mount ID becomes the user `docker-plugin/<ID>`. The `/` can never be in
//! a container id from `run`, `serve`, the OCI hook or `volume publish`
//! (each checks [`validate_container_id`], which refuses it), so a user with
//! this prefix was made by `docker-plugin` and by nothing else: the engine
//! reconciliation touches only these. The prefix is in the volume's durable
//! checkpoint, so it survives restarts.
//!
//! Backward compatibility: versions before the prefix recorded the bare
//! Mount ID. `Unmount` ends either form; the reconciliation never touches a
//! bare one (it cannot be told from a container id), so such a use stays
//! until Docker's `Unmount` or `csi-isolator volume release`.

use crate::resource::validate_container_id;

/// The prefix of every user `docker-plugin` records.
pub const PREFIX: &str = "docker-plugin/";

/// The provider user of a Mount ID (checked with [`validate_container_id`]
/// by the caller).
pub fn user_of(mount_id: &str) -> String {
    format!("{PREFIX}{mount_id}")
}

/// The Mount ID of a user `docker-plugin` recorded, or `None` for any other
/// user (a container's, or a bare Mount ID of an earlier version).
pub fn mount_id_of(user: &str) -> Option<&str> {
    user.strip_prefix(PREFIX)
        .filter(|id| validate_container_id(id).is_ok())
}

/// How a user is shown to the engine (`docker volume inspect`): the Mount ID
/// for ours, the user itself otherwise.
pub fn shown_user(user: &str) -> &str {
    mount_id_of(user).unwrap_or(user)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_prefixed_users_are_docker_plugins() {
        let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let user = user_of(id);
        assert_eq!(user, format!("docker-plugin/{id}"));
        assert!(
            validate_container_id(&user).is_err(),
            "no container id can look like ours"
        );
        for (user, ours) in [
            (user.as_str(), Some(id)),
            (id, None),
            ("c1", None),
            ("docker-plugin/", None),
            ("docker-plugin/a/b", None),
            ("docker-plugin/..", None),
            ("docker-plugin:x", None),
            ("x/docker-plugin/y", None),
        ] {
            assert_eq!(mount_id_of(user), ours, "{user}");
        }
        assert_eq!(shown_user(&user), id);
        assert_eq!(shown_user("c1"), "c1");
    }
}
