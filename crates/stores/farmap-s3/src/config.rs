//! Where the endpoint, region and credentials come from: the spec, the standard AWS
//! environment variables, and the AWS profile files.
//!
//! | what | first found in |
//! |---|---|
//! | credentials | `profile=` of the spec (that profile only); else `AWS_ACCESS_KEY_ID` + `AWS_SECRET_ACCESS_KEY` (+ `AWS_SESSION_TOKEN`); else the profile `AWS_PROFILE` (default `default`) |
//! | region | `region=`; `AWS_REGION`; `AWS_DEFAULT_REGION`; the profile's `region`; `us-east-1` |
//! | endpoint | `endpoint=`; `AWS_ENDPOINT_URL_S3`; `AWS_ENDPOINT_URL`; the profile's `endpoint_url`; AWS |
//!
//! Profiles are read from `AWS_SHARED_CREDENTIALS_FILE` (default `~/.aws/credentials`, sections
//! `[NAME]`) and `AWS_CONFIG_FILE` (default `~/.aws/config`, sections `[profile NAME]` or
//! `[default]`); keys `aws_access_key_id`, `aws_secret_access_key`, `aws_session_token`,
//! `region`, `endpoint_url`. Other ways AWS SDKs find credentials (instance metadata, SSO,
//! web identity, `credential_process`) are not used: farmap never contacts a server other than
//! the endpoint on its own.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use farmap_core::{ErrorKind, StoreError, StoreResult};

use crate::S3Location;

/// The region used when nothing names one.
pub const DEFAULT_REGION: &str = "us-east-1";

/// Largest profile file read (they are a few lines).
const MAX_PROFILE_FILE: u64 = 1 << 20;

/// Static credentials.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Credentials {
    pub key_id: String,
    pub secret: String,
    pub token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    /// The key id only: secrets never reach a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

/// Everything needed to talk to the server, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resolved {
    /// `None`: AWS itself.
    pub endpoint: Option<String>,
    pub region: String,
    pub credentials: Credentials,
    /// Where the credentials came from, for error messages (`AWS_ACCESS_KEY_ID`, `profile
    /// minio in /root/.aws/credentials`).
    pub credentials_from: String,
}

/// One profile's keys, merged from both files.
type Profile = HashMap<String, String>;

/// Reads an INI-style AWS profile file into its sections. `config` files name sections
/// `[profile NAME]` (but `[default]`); credentials files `[NAME]`.
fn parse_profiles(text: &str, config_file: bool) -> HashMap<String, Profile> {
    let mut out: HashMap<String, Profile> = HashMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(section) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let section = section.trim();
            current = if config_file {
                match section.strip_prefix("profile ") {
                    Some(name) => Some(name.trim().to_owned()),
                    None if section == "default" => Some("default".to_owned()),
                    // `[sso-session x]`, `[services x]`: not profiles.
                    None => None,
                }
            } else {
                Some(section.to_owned())
            };
            continue;
        }
        let (Some(name), Some((k, v))) = (&current, line.split_once('=')) else {
            continue;
        };
        out.entry(name.clone())
            .or_default()
            .insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
    }
    out
}

/// Reads a profile file; a missing file is an empty one.
fn read_profile_file(path: &Path, config_file: bool) -> StoreResult<HashMap<String, Profile>> {
    let text = match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(e) => return Err(StoreError::io(format!("reading {}", path.display()), e)),
        Ok(m) if m.len() > MAX_PROFILE_FILE => {
            return Err(StoreError::invalid(format!(
                "{} is larger than {MAX_PROFILE_FILE} bytes: not an AWS profile file",
                path.display()
            )))
        }
        Ok(_) => std::fs::read_to_string(path)
            .map_err(|e| StoreError::io(format!("reading {}", path.display()), e))?,
    };
    Ok(parse_profiles(&text, config_file))
}

/// Resolves endpoint, region and credentials for `loc`, reading the environment through
/// `env` (the process environment in [`crate::S3Store::open`]; a map in tests).
pub(crate) fn resolve(
    loc: &S3Location,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> StoreResult<Resolved> {
    let var = |k: &str| env(k).filter(|v| !v.is_empty());
    let home = var("HOME").map(PathBuf::from);
    let in_home = |rel: &str| home.as_ref().map(|h| h.join(rel));
    let cred_file = var("AWS_SHARED_CREDENTIALS_FILE")
        .map(PathBuf::from)
        .or_else(|| in_home(".aws/credentials"));
    let config_file = var("AWS_CONFIG_FILE")
        .map(PathBuf::from)
        .or_else(|| in_home(".aws/config"));
    let profile_name = loc
        .profile
        .clone()
        .or_else(|| var("AWS_PROFILE"))
        .unwrap_or_else(|| "default".to_owned());
    // The profile, merged: the credentials file wins over the config file.
    let mut profile: Profile = HashMap::new();
    let mut found_in = None;
    for (file, is_config) in [(&config_file, true), (&cred_file, false)] {
        let Some(file) = file else { continue };
        if let Some(p) = read_profile_file(file, is_config)?.remove(&profile_name) {
            if p.contains_key("aws_access_key_id") {
                found_in = Some(file.clone());
            }
            profile.extend(p);
        }
    }
    if loc.profile.is_some() && profile.is_empty() {
        return Err(StoreError::new(
            ErrorKind::InvalidInput,
            format!(
                "profile {profile_name:?} (profile= of {loc}) is in neither {} nor {}",
                show(&cred_file),
                show(&config_file)
            ),
        ));
    }
    let from_profile = || -> Option<(Credentials, String)> {
        let key_id = profile.get("aws_access_key_id")?.clone();
        let secret = profile.get("aws_secret_access_key")?.clone();
        Some((
            Credentials {
                key_id,
                secret,
                token: profile.get("aws_session_token").cloned(),
            },
            format!("profile {profile_name} in {}", show(&found_in)),
        ))
    };
    let from_env = || -> Option<(Credentials, String)> {
        Some((
            Credentials {
                key_id: var("AWS_ACCESS_KEY_ID")?,
                secret: var("AWS_SECRET_ACCESS_KEY")?,
                token: var("AWS_SESSION_TOKEN"),
            },
            "AWS_ACCESS_KEY_ID".to_owned(),
        ))
    };
    let creds = if loc.profile.is_some() {
        from_profile()
    } else {
        from_env().or_else(from_profile)
    };
    let Some((credentials, credentials_from)) = creds else {
        return Err(StoreError::new(
            ErrorKind::PermissionDenied,
            format!(
                "no S3 credentials for {loc}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or \
                 put aws_access_key_id and aws_secret_access_key in profile {profile_name:?} of {} \
                 (choose the profile with profile= or AWS_PROFILE)",
                show(&cred_file)
            ),
        ));
    };
    let region = loc
        .region
        .clone()
        .or_else(|| var("AWS_REGION"))
        .or_else(|| var("AWS_DEFAULT_REGION"))
        .or_else(|| profile.get("region").cloned())
        .unwrap_or_else(|| DEFAULT_REGION.to_owned());
    let endpoint = loc
        .endpoint
        .clone()
        .or_else(|| var("AWS_ENDPOINT_URL_S3"))
        .or_else(|| var("AWS_ENDPOINT_URL"))
        .or_else(|| profile.get("endpoint_url").cloned())
        .map(|e| e.trim_end_matches('/').to_owned());
    Ok(Resolved {
        endpoint,
        region,
        credentials,
        credentials_from,
    })
}

fn show(p: &Option<PathBuf>) -> String {
    match p {
        Some(p) => p.display().to_string(),
        None => "~/.aws/credentials (HOME is not set)".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc() -> S3Location {
        S3Location::parse("//bucket/p").unwrap()
    }

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn environment_variables() {
        let r = resolve(
            &loc(),
            &env_of(&[
                ("AWS_ACCESS_KEY_ID", "AKID"),
                ("AWS_SECRET_ACCESS_KEY", "sekrit"),
                ("AWS_SESSION_TOKEN", "tok"),
                ("AWS_DEFAULT_REGION", "eu-west-1"),
                ("AWS_ENDPOINT_URL", "http://127.0.0.1:9000/"),
                ("HOME", "/nonexistent"),
            ]),
        )
        .unwrap();
        assert_eq!(r.credentials.key_id, "AKID");
        assert_eq!(r.credentials.secret, "sekrit");
        assert_eq!(r.credentials.token.as_deref(), Some("tok"));
        assert_eq!(r.region, "eu-west-1");
        assert_eq!(r.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert!(
            !format!("{r:?}").contains("sekrit"),
            "secrets stay out of Debug"
        );
        // The spec's options win over the environment.
        let mut l = loc();
        l.set("region", "ap-south-1").unwrap();
        l.set("endpoint", "http://10.0.0.1:1").unwrap();
        let r = resolve(
            &l,
            &env_of(&[
                ("AWS_ACCESS_KEY_ID", "AKID"),
                ("AWS_SECRET_ACCESS_KEY", "s"),
                ("AWS_REGION", "eu-west-1"),
                ("AWS_ENDPOINT_URL_S3", "http://x:1"),
            ]),
        )
        .unwrap();
        assert_eq!(r.region, "ap-south-1");
        assert_eq!(r.endpoint.as_deref(), Some("http://10.0.0.1:1"));
    }

    #[test]
    fn profile_files() {
        let dir = std::env::temp_dir().join(format!("farmap-s3-profiles-{}", std::process::id()));
        std::fs::create_dir_all(dir.join(".aws")).unwrap();
        std::fs::write(
            dir.join(".aws/credentials"),
            "# comment\n[default]\naws_access_key_id = DEF\naws_secret_access_key = defsecret\n\n\
             [minio]\naws_access_key_id=MINIO\naws_secret_access_key=miniosecret\n",
        )
        .unwrap();
        std::fs::write(
            dir.join(".aws/config"),
            "[default]\nregion = us-west-2\n[profile minio]\nregion=eu-central-1\n\
             endpoint_url = http://127.0.0.1:9000\n[sso-session x]\nregion=nope\n",
        )
        .unwrap();
        let home = dir.to_str().unwrap();
        // No environment credentials: the default profile.
        let r = resolve(&loc(), &env_of(&[("HOME", home)])).unwrap();
        assert_eq!(r.credentials.key_id, "DEF");
        assert_eq!(r.region, "us-west-2");
        assert_eq!(r.endpoint, None);
        assert!(
            r.credentials_from.contains("profile default"),
            "{}",
            r.credentials_from
        );
        // AWS_PROFILE chooses another; environment keys win over it.
        let r = resolve(&loc(), &env_of(&[("HOME", home), ("AWS_PROFILE", "minio")])).unwrap();
        assert_eq!(r.credentials.key_id, "MINIO");
        assert_eq!(r.region, "eu-central-1");
        assert_eq!(r.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        let both = [
            ("HOME", home),
            ("AWS_PROFILE", "minio"),
            ("AWS_ACCESS_KEY_ID", "ENV"),
            ("AWS_SECRET_ACCESS_KEY", "envsecret"),
        ];
        assert_eq!(
            resolve(&loc(), &env_of(&both)).unwrap().credentials.key_id,
            "ENV"
        );
        // profile= of the spec is used alone.
        let mut l = loc();
        l.set("profile", "minio").unwrap();
        assert_eq!(
            resolve(&l, &env_of(&both)).unwrap().credentials.key_id,
            "MINIO"
        );
        l.set("profile", "missing").unwrap();
        let e = resolve(&l, &env_of(&both)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(e.to_string().contains("\"missing\""), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_credentials_is_a_clear_error() {
        let e = resolve(&loc(), &env_of(&[("HOME", "/nonexistent")])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        let msg = e.to_string();
        assert!(
            msg.contains("AWS_ACCESS_KEY_ID") && msg.contains("/nonexistent/.aws/credentials"),
            "{msg}"
        );
        // A key id without a secret is not credentials.
        let e = resolve(
            &loc(),
            &env_of(&[("HOME", "/nonexistent"), ("AWS_ACCESS_KEY_ID", "X")]),
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
    }
}
